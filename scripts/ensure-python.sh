#!/usr/bin/env bash
# Make sure Python >= 3.11 with venv and pip is there; install Debian's packages when root.
set -euo pipefail
python=${1:-python3}
if ! command -v "$python" >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3 python3-venv python3-pip
  else
    echo "gatewayd needs $python (3.11 or newer); install it, e.g. apt-get install python3 python3-venv" >&2; exit 1
  fi
fi
"$python" - <<'PY' || { echo "gatewayd needs Python 3.11 or newer" >&2; exit 1; }
import sys
sys.exit(0 if sys.version_info >= (3, 11) else 1)
PY
if ! "$python" -c 'import venv, ensurepip' >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv
  else
    echo "gatewayd needs the venv module: apt-get install python3-venv" >&2; exit 1
  fi
fi
