#!/usr/bin/env bash
# Build the web console: its terminal player from the npm registry (the locked version, `npm ci`),
# copied beside the console's own sources in control/console_static/vendor/ (not committed).
# Installs Debian's nodejs and npm when missing and root; otherwise says what is missing and fails.
set -euo pipefail
cd "$(dirname "$0")/.."
vendor=control/console_static/vendor
if ! command -v npm >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing nodejs and npm (Debian) to build the web console" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null
  else
    echo "npm not found: the web console cannot be built (install Node.js and npm, then run make console)" >&2
    exit 1
  fi
fi
npm ci --prefix console --no-audit --no-fund --loglevel=error
mkdir -p "$vendor"
dist=console/node_modules/asciinema-player/dist/bundle
cp "$dist/asciinema-player.min.js" "$dist/asciinema-player.css" "$vendor/"
cp console/node_modules/asciinema-player/LICENSE "$vendor/asciinema-player.LICENSE" 2>/dev/null || true
echo "web console built: $vendor" >&2
