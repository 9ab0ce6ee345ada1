#!/usr/bin/env bash
# On the two-GPU machine, after install.sh: `dbo-runtime tune` for the HT prefill shape of one
# production-width model (tests/e2e/models/<model>: glm53-width or v32-width), into $OUT/tune-<model>.{json,png,log}.
#   tools/gpu/session-tune.sh MODEL [seconds] [values]
set -u
: "${OUT:?set OUT to the directory that receives the results (the device machine sets it)}"
cd "$(dirname "$0")/../.."
MODEL=${1:?model: glm53-width or v32-width}
case "$MODEL" in glm53-width|v32-width) ;; *) echo "session-tune.sh: MODEL '$MODEL' is not allowed; allowed values: glm53-width, v32-width" >&2; exit 2 ;; esac
LIMIT=${2:-540}
case "$LIMIT" in ''|*[!0-9]*) echo "session-tune.sh: seconds '$LIMIT' is not allowed; allowed values: an integer > 60" >&2; exit 2 ;; esac
[ "$LIMIT" -gt 60 ] || { echo "session-tune.sh: seconds '$LIMIT' is not allowed; allowed values: an integer > 60" >&2; exit 2; }
VALUES=${3:-8,12,16}
. tools/gpu/env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . >/dev/null 2>&1 || echo "project install failed"
mapfile -t ARGS < <(python3 -c "from tests.e2e import plan; print('\n'.join(plan.tune_args('$MODEL')))")
timeout "$LIMIT" python3 -m dbo_runtime tune --json --shape prefill --prefill-tokens 8192 --values "$VALUES" \
  --reps 6 --warmup 1 --timeout $((LIMIT - 30)) --workdir "/tmp/tune-$MODEL" --png "$OUT/tune-$MODEL.png" \
  "${ARGS[@]}" > "$OUT/tune-$MODEL.json" 2> "$OUT/tune-$MODEL.log"
rc=$?
echo "exit $rc" >> "$OUT/tune-$MODEL.log"
tar czf "$OUT/tune-$MODEL-runs.tgz" -C /tmp "tune-$MODEL" --exclude='*.whl' 2>/dev/null
tail -5 "$OUT/tune-$MODEL.log"
exit "$rc"
