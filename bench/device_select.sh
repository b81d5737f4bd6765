# Sourced by the device benchmarks: PY (unless set: the venv's python where there is one), gpus, and
# config: $config if the caller set it, else by the GPUs present — 4 or more → deploy/h200x4.yaml
# (80 GB cards: deploy/h100x4.yaml), 2 or 3 → deploy/h200x2.yaml, none → deploy/local-tiny.yaml (the
# CPU tiny run: how the scripts are checked here). On a GPU machine it sources bench/device_env.sh.
if [ -z "${PY:-}" ]; then
  PY=python3
  [ -x .venv/bin/python ] && PY=.venv/bin/python
fi
gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
  source bench/device_env.sh
  nvidia-smi -L
  gpus=$(nvidia-smi -L | grep -c '^GPU')
fi
if [ -z "${config:-}" ]; then
  mib=0
  [ "$gpus" -gt 0 ] && mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  if [ "$gpus" -ge 4 ] && [ "$mib" -lt 100000 ]; then config=deploy/h100x4.yaml  # 80 GB cards
  elif [ "$gpus" -ge 4 ]; then config=deploy/h200x4.yaml
  elif [ "$gpus" -ge 2 ]; then config=deploy/h200x2.yaml
  else config=deploy/local-tiny.yaml
  fi
fi
