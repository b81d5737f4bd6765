# Sourced by the one-call GPU scripts (bench/decode_fusions_gpu.sh, bench/allreduce_gpu.sh): a step that
# fails is named and the rest still run; `steps_done` ends the call with the failed steps' names.
failed=()

step() {  # step NAME CMD...: runs CMD (in an `if`, so a `set -e` inside it stops only it)
  local name=$1
  shift
  echo "=== $name ==="
  if "$@"; then
    echo "--- $name: ok"
  else
    local rc=$?
    echo "FAILED: $name (exit $rc)"
    failed+=("$name")
  fi
}

steps_done() {  # exit 1 naming the failed steps, else 0
  if ((${#failed[@]})); then
    echo "=== FAILED steps: ${failed[*]}"
    exit 1
  fi
  echo "=== every step ok"
}
