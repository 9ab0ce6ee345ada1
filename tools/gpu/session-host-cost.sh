#!/usr/bin/env bash
# On the GPU machine, after install.sh: graphs/bench_host_cost.py, results into $OUT (JSON, PNG, run logs as a tarball).
#   tools/gpu/session-host-cost.sh [seconds] [bench_host_cost.py arguments ...]
set -u
cd "$(dirname "$0")/../.."
. tools/gpu/_checks.sh
need_out session-host-cost.sh
if [ $# = 0 ] || [[ $1 == -* ]]; then LIMIT=540; else LIMIT=$1; shift; fi  # SECONDS may be left out
need_int session-host-cost.sh seconds "$LIMIT" 1 3600
for arg in "$@"; do
  case "$arg" in --out|--out=*|--from-runs|--from-runs=*) echo "session-host-cost.sh: $arg is not allowed; allowed values: bench_host_cost.py's other arguments (this script writes into \$OUT)" >&2; exit 2;; esac
done
# the benchmark's own parser checks its arguments before anything is installed or deleted (it needs no vLLM)
checked=$(python3 graphs/bench_host_cost.py --check --out /tmp/host-cost "$@" 2>&1) || { echo "session-host-cost.sh: ${checked##*$'\n'}" >&2; exit 2; }
. tools/gpu/env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . >/dev/null 2>&1 || echo "project install failed"
# a folder of its own per command: an earlier command's runs went back with its tarball, and would go again
rm -rf /tmp/host-cost && mkdir -p /tmp/host-cost
timeout "$LIMIT" python3 graphs/bench_host_cost.py --out /tmp/host-cost "$@" > /tmp/host-cost/bench.log 2>&1
rc=$?
echo "exit $rc" >> /tmp/host-cost/bench.log
if [ "$rc" != 0 ] && [ -d /tmp/host-cost/bench_host_cost_runs ]; then
  # the limit stopped it: summarize the reps every engine finished (rankN.partial.json), with the row filters
  # only (--from-runs refuses the options that start engines)
  filters=(); skip=0
  for a in "$@"; do
    if [ "$skip" = 1 ]; then skip=0; continue; fi
    case "$a" in
      --reps|--steps|--graphs-steps|--at-once) skip=1 ;;
      --reps=*|--steps=*|--graphs-steps=*|--at-once=*) ;;
      *) filters+=("$a") ;;
    esac
  done
  python3 graphs/bench_host_cost.py --from-runs /tmp/host-cost/bench_host_cost_runs --out /tmp/host-cost "${filters[@]}" >> /tmp/host-cost/bench.log 2>&1
  echo "summarized from the run directories: exit $?" >> /tmp/host-cost/bench.log
fi
cp /tmp/host-cost/bench_host_cost.json /tmp/host-cost/bench_host_cost.png "$OUT/" 2>/dev/null
tar czf "$OUT/host-cost-runs.tgz" -C /tmp/host-cost bench.log bench_host_cost_runs 2>/dev/null
tail -40 /tmp/host-cost/bench.log
exit "$rc"
