#!/usr/bin/env bash
# On the GPU machine, after install.sh: the real-engine benchmarks, results into $OUT/bench.tgz.
#   tools/gpu/session-bench.sh [seconds for bench_real_engine] [seconds for bench_dbo_engine] [groups]
# 0 seconds skips that benchmark; groups are bench_dbo_engine's --backends (default ht,ll). Each
# benchmark needs most of one 10-minute device command on a fresh machine (bench_real_engine: one
# warm-up engine, then ~80 s per plugin/vanilla pair, then the self-time engine; bench_dbo_engine: a
# cold host compiles kernels in every engine), so on a lent machine run them as separate commands:
# `session-bench.sh 560 0`, then `session-bench.sh 0 560 ll` and `session-bench.sh 0 560 ht`
# (on a warm 2x H200 host the LL group takes about 80 s, the HT group about 180 s).
set -u
cd "$(dirname "$0")/../.."
. tools/gpu/_checks.sh
need_out session-bench.sh
S1=${1-560} S2=${2-560} BENCH_GROUPS=${3-ht,ll}  # not GROUPS: bash reserves it
[ "$#" -le 3 ] || { echo "session-bench.sh: arguments '$*' are not allowed; allowed values: [S1] [S2] [GROUPS]" >&2; exit 2; }
need_int session-bench.sh "seconds S1" "$S1" 0 3600
need_int session-bench.sh "seconds S2" "$S2" 0 3600
case "$BENCH_GROUPS" in ht|ll|ht,ll|ll,ht) ;; *) echo "session-bench.sh: GROUPS '$BENCH_GROUPS' is not allowed; allowed values: ht, ll, ht,ll" >&2; exit 2 ;; esac
[ "$S1" != 0 ] || [ "$S2" != 0 ] || { echo "session-bench.sh: seconds '0 0' are not allowed; allowed values: at least one benchmark given seconds (nothing would run)" >&2; exit 2; }
. tools/gpu/env.sh
gpus=$(nvidia-smi -L | wc -l)
if [ "$S2" != 0 ] && [ "$gpus" -lt 2 ]; then
  echo "session-bench.sh: bench_dbo_engine needs 2 GPUs (DBO needs DP >= 2), $gpus visible: run it on nvidia-h200-x2, or give it 0 seconds" >&2; exit 3
fi
status=0
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . >/dev/null 2>&1 || echo "project install failed"
mkdir -p /tmp/bench
if [ "$S1" != 0 ]; then
  CUDA_VISIBLE_DEVICES=0 timeout "$S1" python3 graphs/bench_real_engine.py --reps 5 --budget-s $(( S1 > 180 ? S1 - 150 : 30 )) --out /tmp/bench > /tmp/bench/bench_real_engine.log 2>&1
  rc=$?; [ "$rc" = 0 ] || status=$rc
  echo "bench_real_engine exit $rc" | tee -a /tmp/bench/bench_real_engine.log; tail -30 /tmp/bench/bench_real_engine.log
fi
if [ "$S2" != 0 ]; then
  timeout "$S2" python3 graphs/bench_dbo_engine.py --reps 5 --backends "$BENCH_GROUPS" --out /tmp/bench > /tmp/bench/bench_dbo_engine.log 2>&1
  rc=$?; [ "$rc" = 0 ] || status=$rc
  echo "bench_dbo_engine exit $rc" | tee -a /tmp/bench/bench_dbo_engine.log; grep -v "^rep " /tmp/bench/bench_dbo_engine.log | tail -80
fi
tar czf "$OUT/bench.tgz" -C /tmp bench || { echo "session-bench.sh: could not write $OUT/bench.tgz" >&2; [ "$status" != 0 ] || status=1; }
ls -la "$OUT"
exit "$status"
