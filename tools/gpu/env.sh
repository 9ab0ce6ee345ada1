# Source on the GPU machine after install.sh: vLLM from /tmp/site, this checkout first on the path.
. /tmp/gpu-vllm/env.sh
export PYTHONPATH="$PWD:$PYTHONPATH"
export PYTHONUNBUFFERED=1
# The two-GPU machine shares its host: NVLink multicast stays off everywhere (also in children).
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
