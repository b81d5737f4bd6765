#!/usr/bin/env bash
# The tools tests/deploy and tests/e2e/test_prometheus_live.py run, unpacked into the project's .tools/
# (git-ignored) from Debian's packages: `prometheus` (prometheus, promtool) and `docker-compose` (with
# the python3 modules it needs that this machine lacks). Nothing is installed: no dpkg database entry,
# no service enabled or started, no file outside .tools/; apt's package lists are kept in .tools/apt,
# so it needs no root either. `make test` runs it; tests/conftest.py puts .tools/bin first on PATH.
# Usage: deploy/test-tools.sh   (again: nothing to do once .tools/bin has the three tools)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tools="$root/.tools"
bin="$tools/bin"
if [ -x "$bin/promtool" ] && [ -x "$bin/prometheus" ] && [ -x "$bin/docker-compose" ]; then
  exit 0
fi
if ! command -v apt-get >/dev/null || ! command -v dpkg-deb >/dev/null; then
  echo "deploy/test-tools.sh: apt-get and dpkg-deb are needed to fetch Debian's prometheus and docker-compose" >&2
  exit 1
fi

apt_dir="$tools/apt"
mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$tools/debs" "$tools/root" "$bin"
apt_opts=(-q -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache" -o Debug::NoLocking=1
          -o "APT::Sandbox::User=$(id -un)")
echo "deploy/test-tools.sh: Debian package lists into $apt_dir"
apt-get "${apt_opts[@]}" update >"$tools/apt-update.log" 2>&1 || {
  cat "$tools/apt-update.log" >&2
  exit 1
}

# docker-compose is Python: its python3-* dependencies (recursively) that dpkg does not list as installed.
packages=(prometheus docker-compose)
while read -r dep; do
  if ! dpkg-query -W -f='${Status}' "$dep" 2>/dev/null | grep -q "ok installed"; then
    packages+=("$dep")
  fi
done < <(apt-cache "${apt_opts[@]}" depends --recurse --no-recommends --no-suggests --no-conflicts \
           --no-breaks --no-replaces --no-enhances docker-compose | grep '^python3-' | sort -u)

echo "deploy/test-tools.sh: unpacking ${packages[*]} into $tools/root"
(cd "$tools/debs" && apt-get "${apt_opts[@]}" download "${packages[@]}" >/dev/null)
for deb in "$tools"/debs/*.deb; do
  dpkg-deb -x "$deb" "$tools/root"
done

ln -sf ../root/usr/bin/prometheus "$bin/prometheus"
ln -sf ../root/usr/bin/promtool "$bin/promtool"
cat >"$bin/docker-compose" <<'EOF'
#!/bin/sh
# Debian's docker-compose from .tools/root, on the system python3 with the modules unpacked beside it.
tools="$(cd "$(dirname "$0")/.." && pwd)"
PYTHONPATH="$tools/root/usr/lib/python3/dist-packages${PYTHONPATH:+:$PYTHONPATH}" \
  exec /usr/bin/python3 "$tools/root/usr/bin/docker-compose" "$@"
EOF
chmod +x "$bin/docker-compose"
rm -rf "$tools/debs" "$apt_dir"
"$bin/promtool" --version >/dev/null
"$bin/docker-compose" version >/dev/null
echo "deploy/test-tools.sh: $bin has prometheus, promtool and docker-compose"
