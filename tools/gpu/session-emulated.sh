#!/usr/bin/env bash
# On the GPU machine, after install.sh: the one-GPU DBO emulation matrix (tests/e2e/emulated.py), one record per
# row appended to $OUT/emulated.jsonl, engine logs and results in $OUT/emulated-runs.tgz.
#   tools/gpu/session-emulated.sh [seconds] [tests.e2e.emulated session arguments: --rows --model --layers --runner --at-once]
# SECONDS (60-3600, default 540) comes first when given. Rows (default repro,a-eager,a-control-eager,b-eager,c):
# repro, a-eager, a-control-eager, b-eager, b-control-eager, c, a-graphs, a-control-graphs, b-graphs,
# b-control-graphs, n-eager, n-control-eager, n-graphs, n-control-graphs (floor rows a-control-*, b-control-* are
# added where a row needs them),
# --model ml4 (vLLM 0.34, Mistral Large 4) takes every row above but repro (ml4-emu against ml4-emu-control),
# mtp-k1, mtp-k2, mtp-k3 (--model glm53), v4-mtp (--model v4), t-eager, t-graphs (DBO off: --model glm53|v32|v4|ml4,
# appended to $OUT/transparency.jsonl; t-rows start vanilla twice, the second the run-to-run floor).
# `python3 -m tests.e2e.emulated plan ARGS` lists the engines, MODEL-DEPTH-RUNNER-MODE-plugin|vanilla-commN, then -dbooff,
# -mtpK, -rN (a replica, the run-to-run floor) where they apply (DEPTH "asis": the model's own), and the passes each runs.
# Re-judge a finished session on any machine: python -m tests.e2e.emulated judge --out DIR --rows ROWS --layers N.
# Engines share the GPU: --at-once above the GPU's memory less 4 GiB is refused (on an H100: 2 at 78 layers, 3 at 61).
# Sessions run side by side when each has its own EMU_WORK folder and $OUT, with EMU_INSTALLED=1 once the project is in /tmp/site.
set -u
cd "$(dirname "$0")/../.."
. tools/gpu/_checks.sh
need_out session-emulated.sh
if [ $# = 0 ] || [[ $1 == -* ]]; then LIMIT=540; else LIMIT=$1; shift; fi  # SECONDS may be left out
need_int session-emulated.sh seconds "$LIMIT" 60 3600
need_switch session-emulated.sh EMU_INSTALLED "${EMU_INSTALLED-0}"
need_switch session-emulated.sh JIT_SAVE "${JIT_SAVE-0}"
for arg in "$@"; do
  case "$arg" in --out|--out=*|--seconds|--seconds=*) echo "session-emulated.sh: $arg is set by this script (\$OUT and SECONDS)" >&2; exit 2;; esac
done
# the matrix's own parser checks the arguments before anything is installed (it needs no vLLM)
checked=$(python3 -m tests.e2e.emulated plan "$@" 2>&1) || { echo "session-emulated.sh: ${checked##*$'\n'}" >&2; exit 2; }
WORK=${EMU_WORK:-/tmp/emulated}
# WORK is emptied first: only a new folder, an empty one or an earlier session's (its plan.json), never $OUT or the checkout
case "$(cd "$WORK" 2>/dev/null && pwd -P)" in "$(pwd -P)"|"$(cd "$OUT" && pwd -P)"|/) bad=1 ;; *) bad=0 ;; esac
if [ "$bad" = 1 ] || { [ -e "$WORK" ] && { [ ! -d "$WORK" ] || { [ -n "$(ls -A "$WORK")" ] && [ ! -f "$WORK/plan.json" ]; }; }; }; then
  echo "session-emulated.sh: EMU_WORK '$WORK' is not allowed; allowed values: a new or empty folder, or an earlier session's (it holds plan.json); it is emptied first" >&2; exit 2
fi
. tools/gpu/env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} VLLM_DEEP_GEMM_WARMUP=skip
if [ "${EMU_INSTALLED-0}" != 1 ]; then
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . >/dev/null 2>&1 || echo "project install failed"
fi
# without the entry point vLLM never loads the plugin, and every "plugin" engine would run vanilla
python3 -c 'import importlib.metadata as m, sys; sys.exit(not any(e.name == "dbo_runtime" for e in m.entry_points(group="vllm.general_plugins")))' || {
  echo "session-emulated.sh: vLLM cannot find dbo_runtime's entry point: EMU_INSTALLED=1 is allowed only once the project is installed in /tmp/site (leave it unset to install it here)" >&2; exit 2; }
rm -rf "$WORK" && mkdir -p "$WORK"
echo "engines: $(echo "$checked" | tr '\n' ';')"
# the engines stop 20 s before the limit, so the records are written for whatever ran
timeout "$LIMIT" python3 -m tests.e2e.emulated session --out "$WORK" --seconds $((LIMIT - 20)) "$@" > "$WORK/session.log" 2>&1
rc=$?
echo "exit $rc" >> "$WORK/session.log"
cp "$WORK/emulated.jsonl" "$WORK/transparency.jsonl" "$OUT/" 2>/dev/null
tar czf "$OUT/emulated-runs.tgz" -C "$(dirname "$WORK")" "$(basename "$WORK")" 2>/dev/null
# JIT_SAVE=1: the kernels the engines compiled (vLLM's DeepGEMM folder, then Triton's and TileLang's caches while
# they fit) as $OUT/jit-cache.tgz, one of the 8 files, at most 15 MiB: a larger file does not come back
if [ "${JIT_SAVE-0}" = 1 ]; then
  saved=""
  for dir in .cache/vllm/deep_gemm .triton/cache .tilelang; do
    [ -d ~/"$dir" ] || continue
    (cd ~ && tar czf /tmp/jit-cache.tgz $saved "$dir") || continue  # a folder that changes while read is left out
    [ "$(stat -c %s /tmp/jit-cache.tgz)" -le $((15 << 20)) ] && saved="$saved $dir" && cp /tmp/jit-cache.tgz "$OUT/"
  done
  echo "jit cache:${saved:- nothing compiled was found or fits}"
fi
tail -20 "$WORK/session.log"
exit "$rc"
