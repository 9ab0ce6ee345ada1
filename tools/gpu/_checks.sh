# Sourced by bundle.sh, and by every tools/gpu/session-*.sh before it loads vLLM's environment: a bad argument is one line and exit 2,
# with nothing run or written, so a failed lease command never reads as a finished one.
#   need_out SCRIPT                     OUT must name a writable folder that receives the results
#   need_switch SCRIPT NAME VALUE       VALUE must be 0 or 1 (a typo such as 'yes' would otherwise read as off)
#   need_int SCRIPT NAME VALUE MIN MAX  VALUE must be an integer in [MIN, MAX] ('' is refused, not a default; no
#                                       leading zero, which bash arithmetic would read as octal; at most 9 digits)
case "${1:-}" in  # -h / --help (the sourcing script's first argument): its header comment, nothing run
  -h|--help) awk 'NR == 1 && /^#!/ { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"; exit 0 ;;
esac
need_out() {
  [ -n "${OUT:-}" ] || { echo "$1: OUT is not set; allowed values: the folder that receives the results (the device machine sets it)" >&2; exit 2; }
  { [ -d "$OUT" ] && [ -w "$OUT" ]; } || { echo "$1: OUT '$OUT' is not allowed; allowed values: an existing writable folder (the device machine makes one)" >&2; exit 2; }
}
need_switch() {
  case "$3" in
    0|1) ;;
    *) echo "$1: $2 '$3' is not allowed; allowed values: 0 (off), 1 (on)" >&2; exit 2 ;;
  esac
}
need_int() {
  case "$3" in
    ''|*[!0-9]*|0?*|??????????*) echo "$1: $2 '$3' is not allowed; allowed values: an integer in [$4, $5] (digits only, no leading zero)" >&2; exit 2 ;;
  esac
  { [ "$3" -ge "$4" ] && [ "$3" -le "$5" ]; } || { echo "$1: $2 '$3' is not allowed; allowed values: an integer in [$4, $5]" >&2; exit 2; }
}
