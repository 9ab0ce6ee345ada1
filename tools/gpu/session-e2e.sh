#!/usr/bin/env bash
# On the GPU machine, after install.sh: the real-engine tests (tests/e2e) with the GPU twins
# (tests/gpu, real DeepGEMM wheel without vLLM on the path) beside them, everything collected
# into $OUT/e2e.tgz even when a limit stops the tests.
#   tools/gpu/session-e2e.sh ["e2e or e2e_dp2"] [seconds] [pytest -k expression]
# E2E=0 runs only the twins (TWINS=0 only the e2e tests; each 0 or 1; the twins use a carried .whl, else vLLM's vendored DeepGEMM). Exit status:
# the e2e tests', else the twins'.
# With DBO_E2E_LOAD_FORMAT=dbo_runtime_random, tools/gpu/check_load_format.py first loads one tiny model
# with it; if that fails the plan falls back to vLLM's dummy weights (the default), and says so.
set -u
cd "$(dirname "$0")/../.."
. tools/gpu/_checks.sh
need_out session-e2e.sh
MARK=${1-"e2e or e2e_dp2"}
LIMIT=${2-540}
KEXPR=${3:-}
[ -n "$MARK" ] || { echo "session-e2e.sh: MARK '' is not allowed; allowed values: a pytest -m expression (default \"e2e or e2e_dp2\")" >&2; exit 2; }
# pytest's own parser, where pytest is importable (a malformed -m would otherwise fail only after the twins ran)
python3 -c 'import sys; from _pytest.mark.expression import Expression; Expression.compile(sys.argv[1])' "$MARK" 2>/dev/null \
  || ! python3 -c 'import _pytest.mark.expression' 2>/dev/null \
  || { echo "session-e2e.sh: MARK '$MARK' is not allowed; allowed values: a pytest -m expression (default \"e2e or e2e_dp2\")" >&2; exit 2; }
unknown=$(python3 -c 'import re, sys, tomllib
known = {m.split(":")[0].split("(")[0] for m in tomllib.load(open("pyproject.toml", "rb"))["tool"]["pytest"]["ini_options"]["markers"]}
print(" ".join(sorted(set(re.findall(r"[A-Za-z_]\w*", sys.argv[1])) - known - {"and", "or", "not"})))' "$MARK" 2>/dev/null)
[ -z "$unknown" ] || { echo "session-e2e.sh: MARK '$MARK' is not allowed; allowed values: a pytest -m expression of the markers in pyproject.toml (unknown: $unknown)" >&2; exit 2; }
[ "$#" -le 3 ] || { echo "session-e2e.sh: arguments '$*' are not allowed; allowed values: [MARK] [SECONDS] [KEXPR]" >&2; exit 2; }
need_int session-e2e.sh seconds "$LIMIT" 1 3600
need_int session-e2e.sh TWIN_LIMIT "${TWIN_LIMIT-300}" 1 3600
need_switch session-e2e.sh E2E "${E2E-1}"
need_switch session-e2e.sh TWINS "${TWINS-1}"
[ "${E2E-1}" = 1 ] || [ "${TWINS-1}" = 1 ] || { echo "session-e2e.sh: E2E=0 with TWINS=0 is not allowed; allowed values: at least one of them 1 (nothing would run)" >&2; exit 2; }
for b in ${TWIN_BENCHES-}; do
  [ -f "graphs/$b" ] || { echo "session-e2e.sh: TWIN_BENCHES '$b' is not allowed; allowed values: graphs/ script names, space-separated (e.g. bench_planner_warmup.py), or empty" >&2; exit 2; }
done
if [ "${E2E-1}" = 1 ]; then
  # the e2e suites' own settings (plan.env_problems, what collection would refuse), before anything is installed
  problems=$(python3 -c 'from tests.e2e import plan; print("; ".join(plan.env_problems()))' 2>&1) || {
    echo "session-e2e.sh: the e2e settings could not be checked: ${problems##*$'\n'}" >&2; exit 2; }
  [ -z "$problems" ] || { echo "session-e2e.sh: $problems" >&2; exit 2; }
fi
# The twins' DeepGEMM: the tokenspeed wheel carried in .whl/, else the copy vLLM vendors (vllm.third_party.deep_gemm).
TWIN_DG=wheel
ls .whl/tokenspeed_deepgemm*.whl >/dev/null 2>&1 || TWIN_DG=vendored
. tools/gpu/env.sh
# Dozens of engines share 32 cores while they start: one or two intra-op threads each (vLLM gives
# its multiproc workers 1) keep them from oversubscribing the host.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
export DBO_E2E_OUT=/tmp/e2e-out DBO_E2E_RECORD_DIR=/tmp/e2e-records DBO_E2E_MAX_ENGINES=${DBO_E2E_MAX_ENGINES:-16}
mkdir -p "$DBO_E2E_OUT" "$DBO_E2E_RECORD_DIR"
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . >/dev/null 2>&1 || echo "project install failed"
{ nvidia-smi -L; python3 -c 'import torch, vllm; print("torch", torch.__version__, "vllm", vllm.__version__, "gpus", torch.cuda.device_count())'; } 2>&1 | tee "$DBO_E2E_OUT/env.txt"
if [ "${TWINS-1}" = 1 ]; then
  (
    mkdir -p /tmp/dg
    if [ "$TWIN_DG" = wheel ]; then
      python3 -m pip install -q --no-index --no-deps --target /tmp/dg .whl/tokenspeed_deepgemm*.whl $(ls /tmp/gpu-vllm/bundle/wheels/tokenspeed_deepep*.whl 2>/dev/null) >/dev/null 2>&1
      WITH_VLLM="/tmp/dg:$PYTHONPATH"
      export PYTHONPATH=/tmp/dg:$PWD
    else  # `import deep_gemm` gives vLLM's vendored module
      printf 'import sys\nimport vllm.third_party.deep_gemm as _vendored\n\nsys.modules[__name__] = _vendored\n' > /tmp/dg/deep_gemm.py
      export PYTHONPATH=/tmp/dg:$PYTHONPATH
      WITH_VLLM=$PYTHONPATH
    fi
    echo "twins' DeepGEMM: $TWIN_DG" > "$DBO_E2E_OUT/twins-deep-gemm.txt"
    export CUDA_VISIBLE_DEVICES=$(( $(nvidia-smi -L | wc -l) - 1 ))
    # The twins write one JSON per case into $OUT: keep them in the tarball, not beside it.
    export OUT="$DBO_E2E_OUT/twins"; mkdir -p "$OUT"
    DBO_REQUIRE_GPU=1 timeout "${TWIN_LIMIT:-300}" python3 -X faulthandler -m pytest tests/gpu -q -p no:cacheprovider -rfE > "$DBO_E2E_OUT/gpu-twins.log" 2>&1
    twins_rc=$?
    echo "exit $twins_rc" >> "$DBO_E2E_OUT/gpu-twins.log"
    # The twins that need vLLM's own CUDA ops (the top-k backends the OOM placeholder passes through), one
    # process per backend: a backend that kills its process must not hide the others' results.
    for b in per_row persistent cooperative torch; do
      PYTHONPATH="$WITH_VLLM" DBO_REQUIRE_GPU=1 timeout 60 python3 -X faulthandler -m pytest tests/gpu/test_placeholder_topk_gpu.py -k "$b" -q -p no:cacheprovider -rfE >> "$DBO_E2E_OUT/gpu-twins-with-vllm.log" 2>&1
      rc=$?; [ "$rc" = 0 ] || twins_rc=$rc
      echo "$b: exit $rc" >> "$DBO_E2E_OUT/gpu-twins-with-vllm.log"
    done
    for b in ${TWIN_BENCHES-bench_replay_planning.py bench_planner_warmup.py}; do timeout 200 python3 "graphs/$b" --out "$DBO_E2E_OUT/twin-bench" > "$DBO_E2E_OUT/$b.log" 2>&1; echo "exit $?" >> "$DBO_E2E_OUT/$b.log"; done
    exit "$twins_rc"
  ) &
  twins_pid=$!
fi
if [ "${DBO_E2E_LOAD_FORMAT:-dummy}" = dbo_runtime_random ]; then
  CUDA_VISIBLE_DEVICES=0 timeout 240 python3 tools/gpu/check_load_format.py "$DBO_E2E_OUT/load-format-check" 2>&1 | tail -5 | tee "$DBO_E2E_OUT/load-format-check.txt"
  case "${PIPESTATUS[0]}" in
    0) ;;
    1) echo "load format check failed: falling back to --load-format dummy"; export DBO_E2E_LOAD_FORMAT=dummy ;;
    *) echo "load format check could not run here: stopping"; exit 2 ;;
  esac
fi
status=0
if [ "${E2E-1}" = 1 ]; then
  # DBO_REQUIRE_GPU=1: a missing GPU, vLLM or DeepGEMM fails the tests instead of skipping them
  DBO_REQUIRE_GPU=1 timeout "$LIMIT" python3 -m pytest tests/e2e -m "$MARK" ${KEXPR:+-k "$KEXPR"} -q -s -p no:cacheprovider -rA 2>&1 | tee "$DBO_E2E_OUT/pytest.log" | grep -v "^\[e2e\]" | tail -60
  status=${PIPESTATUS[0]}
fi
if [ -n "${twins_pid:-}" ]; then
  wait "$twins_pid"; rc=$?
  [ "$rc" = 0 ] || { echo "GPU twins: exit $rc (gpu-twins.log, gpu-twins-with-vllm.log in e2e.tgz)"; [ "$status" != 0 ] || status=$rc; }
fi
wait
tar czf "$OUT/e2e.tgz" -C /tmp --exclude='*/prometheus' e2e-out e2e-records 2>/dev/null
ls -la "$OUT"
exit "$status"
