#!/usr/bin/env bash
# Build the real vLLM (0.33.0 or 0.34.0) for the GPU machine, as parts small enough to send one per command.
#
# Run from the project root on a CPU machine with PyPI access (needs ~2 GB in /tmp, 2-4 min):
#     bash tools/gpu/bundle.sh                     # vLLM 0.34.0 -> .gpu-vllm/p0 .. .gpu-vllm/pN (git-ignored)
#     VLLM_VERSION=0.33.0 bash tools/gpu/bundle.sh # vLLM 0.33.0 (another release: add its gpu-extra-lock-<version>.txt)
#     DRY_RUN=1 VLLM_VERSION=0.34.0 bash tools/gpu/bundle.sh   # what would be downloaded and removed; nothing written
# Then send ONE part directory with each command (p0, then p1, ...), each command starting
#     mkdir -p /tmp/gpu-vllm && cp .gpu-vllm/pK/* /tmp/gpu-vllm/
# and, with the last part, run install.sh there (see tools/gpu/README.md).
#
# What is in it and why:
#  * vllm $VLLM_VERSION (the official wheel) unpacked, minus what an H200 DSA run never loads:
#    the FA2 extension (FA3 is kept), the vllm-rs frontend binary, qutlass and the
#    SM100 FMHA headers. vLLM 0.33's kernels are built on torch's stable ABI, so they load on
#    the GPU image's torch 2.11 (checked: every torch symbol they import is exported by 2.11).
#  * gpu-extra-lock.txt: the Python packages vLLM imports that the GPU image lacks, DeepEP
#    (tokenspeed-deepep 1.2.1, v1 API), the CuTe DSL + quack kernels the DSA attention imports,
#    llguidance (imported for a type annotation), and tilelang with its dependencies (DeepSeek-V4 / V4.1's
#    mHC kernels: without it vLLM 0.33.0 cannot start those models). gpu-extra-lock-<version>.txt adds what
#    one release needs beyond it (0.34.0 raises its floors on huggingface_hub, filelock and tokenizers).
#  * parts of at most 50 MB: a part plus the tracked tree stays under the 64 MiB a command can bring.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
[[ "${1:-}" != -h && "${1:-}" != --help ]] || . "$here/_checks.sh"  # prints this header
out=${1:-.gpu-vllm}
version=${VLLM_VERSION:-0.34.0}
[[ "$version" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || { echo "bundle.sh: VLLM_VERSION '$version' is not allowed; allowed values: a vLLM release such as 0.34.0" >&2; exit 2; }
locks=("$here/gpu-extra-lock.txt")
[ ! -f "$here/gpu-extra-lock-$version.txt" ] || locks+=("$here/gpu-extra-lock-$version.txt")
if [ "$version" != 0.33.0 ] && [ ${#locks[@]} = 1 ]; then  # gpu-extra-lock.txt alone is 0.33.0's set
  known=$(cd "$here" && ls gpu-extra-lock-*.txt | sed 's/gpu-extra-lock-\(.*\)\.txt/\1/' | tr '\n' ' ')
  echo "bundle.sh: VLLM_VERSION '$version' is not allowed; allowed values: 0.33.0 $known(another release: add tools/gpu/gpu-extra-lock-$version.txt)" >&2
  exit 2
fi
drop=(vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm-rs vllm/_qutlass_C.abi3.so vllm/third_party/fmha_sm100)
. "$here/_checks.sh"
need_switch bundle.sh DRY_RUN "${DRY_RUN-0}"
# The folder is replaced at the end (rm -rf): only a new one, or an earlier bundle (p0, p1, ... and nothing else).
case "$out" in
  ''|-*|/*|.|..|*/*|.git*) echo "bundle.sh: folder '$out' is not allowed; allowed values: a new folder name in the project root (default .gpu-vllm)" >&2; exit 2 ;;
esac
if [[ "$out" =~ -([0-9]+\.[0-9]+(\.[0-9]+)?)$ ]] && [[ "$version." != "${BASH_REMATCH[1]}."* ]]; then
  echo "bundle.sh: folder '$out' names vLLM ${BASH_REMATCH[1]} but VLLM_VERSION is $version; allowed values: VLLM_VERSION=${BASH_REMATCH[1]}... for that folder, or another folder name" >&2; exit 2
fi
if [ -e "$out" ] && { [ ! -d "$out" ] || [ -n "$(find "$out" -mindepth 1 -maxdepth 1 ! -name 'p[0-9]*' -print -quit)" ]; }; then
  echo "bundle.sh: folder '$out' is not allowed; allowed values: a new folder, or an earlier bundle (only p0, p1, ... inside): it holds other files and would be deleted" >&2; exit 2
fi
if [ "${DRY_RUN-0}" = 1 ]; then
  echo "vllm==$version; extra wheels from ${locks[*]##*/}: $(cat "${locks[@]}" | grep -c .)"
  echo "removed from the wheel: ${drop[*]}"
  echo "parts of at most 50000000 bytes into $out/p0..pN; install.sh and the checksum with the last"
  exit 0
fi
work=$(mktemp -d /tmp/gpu-vllm.XXXX)
trap 'rm -rf "$work"' EXIT  # a build stopped midway leaves no gigabyte behind
if [ -d .git/info ]; then grep -qx "/$out/" .git/info/exclude 2>/dev/null || echo "/$out/" >> .git/info/exclude; fi
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
      --platform manylinux_2_5_x86_64 --platform any)
echo "downloading vllm $version and $(cat "${locks[@]}" | grep -c .) extra wheels ..."
python3 -m pip download -q --no-deps "${plat[@]}" -d "$work/dl" "vllm==$version"
mkdir -p "$work/bundle/wheels"
reqs=(); for l in "${locks[@]}"; do reqs+=(-r "$l"); done
python3 -m pip download -q --no-deps "${plat[@]}" -d "$work/bundle/wheels" "${reqs[@]}"
mkdir -p "$work/tree" && (cd "$work/tree" && python3 -m zipfile -e "$work"/dl/vllm-"$version"-*.whl .)
for d in "${drop[@]}"; do rm -rf "${work:?}/tree/$d"; done
echo "packing (xz) ..."
tar -C "$work/tree" -cf - . | xz -T0 -6 > "$work/bundle/vllm-tree.tar.xz"
tar -C "$work" -cf "$work/bundle.tar" bundle
rm -rf "$out" && mkdir -p "$out"
split -b 50000000 -d -a 1 "$work/bundle.tar" "$work/part"
n=0; for p in "$work"/part*; do mkdir -p "$out/p$n"; mv "$p" "$out/p$n/"; n=$((n+1)); done
cp "$here/install.sh" "$out/p$((n-1))/"
( cd "$work" && sha256sum bundle.tar | cut -d' ' -f1 ) > "$out/p$((n-1))/bundle.sha256"
rm -rf "$work"
du -sh "$out"/p*
echo "$n parts in $out/: send p0 .. p$((n-1)) one per command; install.sh and the checksum travel with the last."
