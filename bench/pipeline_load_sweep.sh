#!/usr/bin/env bash
# The pipeline load benchmark (issue 13): `bench/pipeline_load_sweep.sh [CONFIG]` — CONFIG
# (default bench/gpu-tiny.yaml: the tiny checkpoint, every stage on cuda:0; deploy/local-tiny.yaml
# on CPU) started once, then through its gateway (one pipeline_load run per level, each
# with its results.json, joined afterwards by --replot): closed-loop text sweeps c = 1 ... 64, a
# Poisson run at 1.5x the measured text capacity, and closed sweeps of speech and image requests.
# On the device machine run it from the repo root (carry .cache/tiny-ming and .cache/transport-whl);
# here, with the venv's python first on PATH. Results land in $OUT (results.json per part, serve.log);
# $DEADLINE_S is the text requests' client and goodput deadline (default 5 s); $LEVEL_TIMEOUT_S bounds
# each level's run (default 150 s).
CONFIG=${1:-bench/gpu-tiny.yaml}
[ -f bench/device_env.sh ] && [ -n "$(command -v nvidia-smi)" ] && source bench/device_env.sh
OUT=${OUT:-bench/load}
D=${DEADLINE_S:-5}
mkdir -p "$OUT"
command -v nvidia-smi >/dev/null && nvidia-smi -L
python -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')"
ready=/tmp/omnistage-ready
rm -f "$ready"
python -m omnistage.common.cli serve "$CONFIG" --ready-file "$ready" >"$OUT/serve.log" 2>&1 &
serve=$!
for _ in $(seq 600); do [ -s "$ready" ] && break; kill -0 $serve 2>/dev/null || break; sleep 1; done
if [ ! -s "$ready" ]; then echo "pipeline did not start"; tail -50 "$OUT/serve.log"; exit 1; fi
addr=$(cat "$ready")
grep -E "ready in|serving \(" "$OUT/serve.log"
load() { timeout "${LEVEL_TIMEOUT_S:-150}" python load_tests/pipeline_load.py --address "$addr" "$@" | grep -E "^\| (closed|offline|poisson)" | head -1; }
# One run per level (requests = max(16, 4c)): each writes its own results.json; --replot joins them.
for c in 1 2 4 8 16 32 64; do
  load --kinds text --modes closed --concurrency $c --requests $((c * 4 > 16 ? c * 4 : 16)) --max-tokens 32 \
       --deadline-s $D --timeout-s $D --out "$OUT/text-c$c"
done
cap=$(python -c "import json,glob; print(max(json.load(open(p))['runs'][0]['goodput_per_s'] for p in glob.glob('$OUT/text-c*/results.json')))")
rate=$(python -c "print(round(1.5 * $cap, 1))")
echo "text capacity ${cap} req/s (best closed-loop goodput); Poisson at 1.5x = ${rate}/s"
# The client's deadline is the goodput deadline (the gateway admits by it); then the same arrivals
# with a far deadline (300 s), as a client that sets none: the gateway admits what it can hold.
load --kinds text --modes poisson --rates "$rate" --requests $(python -c "print(int(10 * $rate))") \
     --max-tokens 32 --deadline-s $D --timeout-s $D --out "$OUT/poisson"
load --kinds text --modes poisson --rates "$rate" --requests $(python -c "print(int(10 * $rate))") \
     --max-tokens 32 --deadline-s $D --timeout-s 300 --out "$OUT/poisson-far-deadline"
for c in 1 4 16; do
  load --kinds speech --modes closed --concurrency $c --requests $((c * 2 > 8 ? c * 2 : 8)) --max-tokens 24 \
       --deadline-s 30 --timeout-s 30 --out "$OUT/speech-c$c"
done
for c in 1 4 8; do
  load --kinds image --modes closed --concurrency $c --requests $((c * 2 > 8 ? c * 2 : 8)) --image-size 256 \
       --image-steps 8 --deadline-s 30 --timeout-s 30 --out "$OUT/image-c$c"
done
grep -E "restarting|died|hung" "$OUT/serve.log" || echo "no restarts during the runs"
kill -TERM $serve
wait $serve
echo "serve exit $?"
