#!/usr/bin/env bash
# Install the real protocol peers the test suite drives (Debian packages), when missing.
# As root they are installed; otherwise the suites that need them skip with a reason.
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t wanted < <(grep -v '^\s*#' tests/peers.txt | awk 'NF {print $1}')
missing=()
for pkg in "${wanted[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "not root: not installing ${missing[*]} (tests that need them will skip)" >&2
  exit 0
fi
echo "installing test peers: ${missing[*]}" >&2
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
