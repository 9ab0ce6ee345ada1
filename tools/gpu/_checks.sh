# Sourced by every tools/gpu/session-*.sh before it loads vLLM's environment: a bad argument is one line and exit 2,
# with nothing run or written, so a failed lease command never reads as a finished one.
#   need_out SCRIPT                     OUT must name the folder that receives the results
#   need_int SCRIPT NAME VALUE MIN MAX  VALUE must be an integer in [MIN, MAX] ('' is refused, not a default; no
#                                       leading zero, which bash arithmetic would read as octal; at most 9 digits)
need_out() {
  [ -n "${OUT:-}" ] || { echo "$1: OUT is not set; allowed values: the folder that receives the results (the device machine sets it)" >&2; exit 2; }
}
need_int() {
  case "$3" in
    ''|*[!0-9]*|0?*|??????????*) echo "$1: $2 '$3' is not allowed; allowed values: an integer in [$4, $5]" >&2; exit 2 ;;
  esac
  { [ "$3" -ge "$4" ] && [ "$3" -le "$5" ]; } || { echo "$1: $2 '$3' is not allowed; allowed values: an integer in [$4, $5]" >&2; exit 2; }
}
