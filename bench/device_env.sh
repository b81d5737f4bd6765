# Source on a lent GPU machine (no network, no pip install of this repo): installs the carried
# wheels (.cache/transport-whl, written here by bench/device_wheels.sh: protobuf matching our
# generated code, grpcio + health + reflection for `omnistage serve`) into /tmp/site and makes the
# `omnistage` namespace importable from this checkout through symlinks.
set -e
for wheels in .cache/transport-whl .cache/bench-whl; do  # bench-whl: bench/device_wheels.sh bench (diffusers)
  if ls $wheels/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels/*.whl
  fi
done
mkdir -p /tmp/ns/omnistage
ln -sfn "$PWD/common" /tmp/ns/omnistage/common
ln -sfn "$PWD/services" /tmp/ns/omnistage/services
ln -sfn "$PWD/protos/omnistage/v1" /tmp/ns/omnistage/v1
export PYTHONPATH=/tmp/site:/tmp/ns${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
set +e
