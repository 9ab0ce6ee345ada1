#!/usr/bin/env bash
# On the GPU machine, after install.sh: graphs/bench_hook_calls.py on this host's CPU -- the one that pays for every
# hooked call in an eager step -- back to back (warm) and after COLD random reads per access (default 5000), for each
# source tree given (default: this checkout; another tree, e.g. an earlier commit's `git archive`, for a before/after
# on one host), one after the other so they never share the cores. Results into $OUT/hook-calls/<tree>-{warm,cold}/.
# First graphs/bench_sm_count_read.py (seconds): vLLM's vendored DeepGEMM get_num_sms, a torch op, against the
# call site's cached read, into $OUT/hook-calls/sm-count-read/. Exit status: the first benchmark that failed.
#   tools/gpu/session-hook-calls.sh [TREE ...]
set -u
cd "$(dirname "$0")/../.."
. tools/gpu/_checks.sh
need_out session-hook-calls.sh
COLD=${COLD-5000}
need_int session-hook-calls.sh COLD "$COLD" 1 1000000
[ "$#" -gt 0 ] || set -- .
names=()
for tree in "$@"; do  # every tree checked before anything runs
  if [ ! -f "$tree/graphs/bench_hook_calls.py" ]; then
    echo "session-hook-calls.sh: tree '$tree' is not allowed: it has no graphs/bench_hook_calls.py (allowed: source trees of this project)" >&2
    exit 2
  fi
  name=$( [ "$(cd "$tree" && pwd)" = "$PWD" ] && echo current || basename "$(cd "$tree" && pwd)" | tr -d . )
  for seen in "${names[@]}"; do
    [ "$seen" != "$name" ] || { echo "session-hook-calls.sh: trees '$*' are not allowed: two are named '$name' (give trees with distinct folder names)" >&2; exit 2; }
  done
  names+=("$name")
done
. tools/gpu/env.sh
mkdir -p "$OUT/hook-calls"
{ lscpu | grep -E "^(Model name|CPU\(s\)|Thread|L3)"; nproc; } > "$OUT/hook-calls/host.txt" 2>&1
status=0
timeout 120 python3 graphs/bench_sm_count_read.py --out "$OUT/hook-calls/sm-count-read" > "$OUT/hook-calls/sm-count-read.log" 2>&1
rc=$?; [ "$rc" = 0 ] || status=$rc
echo "exit $rc" >> "$OUT/hook-calls/sm-count-read.log"
grep -E "^(op:|torch|LiveNumSms|plain|exit)" "$OUT/hook-calls/sm-count-read.log"
i=0
for tree in "$@"; do
  name=${names[$i]}; i=$((i + 1))
  for mode in warm cold; do
    if [ "$mode" = warm ]; then args=(--n 100000 --reps 7); else args=(--n 200 --reps 15 --cold "$COLD"); fi
    dest="$OUT/hook-calls/$name-$mode"
    (cd "$tree" && timeout 300 python3 graphs/bench_hook_calls.py "${args[@]}" --out "$dest") > "$dest.log" 2>&1
    rc=$?; [ "$rc" = 0 ] || { [ "$status" != 0 ] || status=$rc; }
    echo "exit $rc" >> "$dest.log"
    grep -E "^(access|78-layer|Sparse|Deepseek|fp8|ubatch|exit)" "$dest.log" | sed "s/^/$name-$mode  /"
  done
done
exit "$status"
