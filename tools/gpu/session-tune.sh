#!/usr/bin/env bash
# On the two-GPU machine, after install.sh: `dbo-runtime tune` for the HT prefill shape of one
# production-width model (tests/e2e/models/<model>: glm53-width or v32-width), into $OUT/tune-<model>.{json,log} and
# its run folders as $OUT/tune-<model>-runs.tgz.
#   tools/gpu/session-tune.sh MODEL [seconds] [values]
set -u
cd "$(dirname "$0")/../.."
. tools/gpu/_checks.sh
need_out session-tune.sh
MODEL=${1-}
case "$MODEL" in glm53-width|v32-width) ;; *) echo "session-tune.sh: MODEL '$MODEL' is not allowed; allowed values: glm53-width, v32-width" >&2; exit 2 ;; esac
LIMIT=${2-540}
need_int session-tune.sh seconds "$LIMIT" 61 3600
VALUES=${3-8,12,16}
[ "$#" -le 3 ] || { echo "session-tune.sh: arguments '$*' are not allowed; allowed values: MODEL [SECONDS] [VALUES]" >&2; exit 2; }
# tune's own rules (core.comm_sweep, no vLLM needed), before anything is installed: 'all' or even counts in [2, 20]
# and 0; and the rounds its sign test needs for that many values (6, or more for a longer sweep such as 'all')
REPS=$(python3 -c 'import sys; from dbo_runtime.core.comm_sweep import ALPHA, plan_sweep, rounds_needed
from dbo_runtime.core.errors import ConfigError
try: sweep = plan_sweep(sys.argv[1], backend="deepep_high_throughput", platform="cuda", environ={})
except ConfigError as exc: sys.exit(f"session-tune.sh: VALUES: {exc}")
print(max(6, rounds_needed(len(sweep.values) - 1, ALPHA)))' "$VALUES") || exit 2
. tools/gpu/env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . >/dev/null 2>&1 || echo "project install failed"
mapfile -t ARGS < <(python3 -c "from tests.e2e import plan; print('\n'.join(plan.tune_args('$MODEL')))")
timeout "$LIMIT" python3 -m dbo_runtime tune --json --shape prefill --prefill-tokens 8192 --values "$VALUES" \
  --reps "$REPS" --warmup 1 --timeout $((LIMIT - 30)) --workdir "/tmp/tune-$MODEL" \
  "${ARGS[@]}" > "$OUT/tune-$MODEL.json" 2> "$OUT/tune-$MODEL.log"
rc=$?
echo "exit $rc" >> "$OUT/tune-$MODEL.log"
tar czf "$OUT/tune-$MODEL-runs.tgz" -C /tmp "tune-$MODEL" --exclude='*.whl' 2>/dev/null
tail -5 "$OUT/tune-$MODEL.log"
exit "$rc"
