# Sourced by the one-call GPU scripts (bench/decode_*_gpu.sh, bench/allreduce_gpu.sh): a step that
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

device_preamble() {  # the carried wheels and this checkout importable (bench/device_env.sh), and the machine
  source bench/device_env.sh || true  # its `set -e` is off in a `||` list: the imports step says if it worked
  step "imports (carried wheels, omnistage from this checkout)" \
    python3 -c "import grpc, google.protobuf, omnistage.services.thinker.group.startup"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
}
