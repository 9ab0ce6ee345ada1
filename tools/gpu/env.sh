# Source on the GPU machine after install.sh: vLLM from /tmp/site, this checkout first on the path.
# Without install.sh's environment there is no vLLM to run: a sourcing script stops here (exit 2); an interactive
# shell gets status 2 and stays open.
GPU_ENV=${DBO_GPU_ENV:-/tmp/gpu-vllm/env.sh}
if [ ! -f "$GPU_ENV" ]; then
  echo "$(basename "${BASH_SOURCE[1]:-${BASH_SOURCE[0]}}"): $GPU_ENV is missing: send every bundle part (.gpu-vllm/p0..pN) and run /tmp/gpu-vllm/install.sh first (tools/gpu/README.md)" >&2
  case $- in *i*) return 2 ;; *) exit 2 ;; esac
fi
. "$GPU_ENV"
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
export PYTHONUNBUFFERED=1
# The two-GPU machine shares its host: NVLink multicast stays off everywhere (also in children).
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
