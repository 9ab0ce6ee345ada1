#!/usr/bin/env bash
# On the GPU machine, after install.sh: graphs/bench_hook_calls.py on this host's CPU -- the one that pays for every
# hooked call in an eager step -- back to back (warm) and after COLD random reads per access (default 5000), for each
# source tree given (default: this checkout; another tree, e.g. an earlier commit's `git archive`, for a before/after
# on one host), one after the other so they never share the cores. Results into $OUT/hook-calls/<tree>-{warm,cold}/.
# First graphs/bench_sm_count_read.py (seconds): vLLM's vendored DeepGEMM get_num_sms, a torch op, against the
# call site's cached read, into $OUT/hook-calls/sm-count-read/.
#   tools/gpu/session-hook-calls.sh [TREE ...]
set -u
: "${OUT:?set OUT (the device machine sets it)}"
cd "$(dirname "$0")/../.."
. tools/gpu/env.sh
COLD=${COLD:-5000}
[ "$#" -gt 0 ] || set -- .
mkdir -p "$OUT/hook-calls"
{ lscpu | grep -E "^(Model name|CPU\(s\)|Thread|L3)"; nproc; } > "$OUT/hook-calls/host.txt" 2>&1
timeout 120 python3 graphs/bench_sm_count_read.py --out "$OUT/hook-calls/sm-count-read" > "$OUT/hook-calls/sm-count-read.log" 2>&1
echo "exit $?" >> "$OUT/hook-calls/sm-count-read.log"
grep -E "^(op:|torch|LiveNumSms|plain)" "$OUT/hook-calls/sm-count-read.log"
for tree in "$@"; do
  if [ ! -f "$tree/graphs/bench_hook_calls.py" ]; then echo "$tree: no graphs/bench_hook_calls.py there"; exit 2; fi
  name=$( [ "$tree" = . ] && echo current || basename "$tree" | tr -d . )
  for mode in warm cold; do
    if [ "$mode" = warm ]; then args=(--n 100000 --reps 7); else args=(--n 200 --reps 15 --cold "$COLD"); fi
    dest="$OUT/hook-calls/$name-$mode"
    (cd "$tree" && timeout 300 python3 graphs/bench_hook_calls.py "${args[@]}" --out "$dest") > "$dest.log" 2>&1
    echo "exit $?" >> "$dest.log"
    grep -E "^(access|78-layer|Sparse|Deepseek|fp8|ubatch)" "$dest.log" | sed "s/^/$name-$mode  /"
  done
done
