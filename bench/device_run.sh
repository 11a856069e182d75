#!/usr/bin/env bash
# On the lent machine, from the project's root: unpack what bench/device_bundle.py added to .bench-bundle (the hot
# path built for Python 3.12, a baseline tree), then run ../shared/bench-machine's run-bench.sh with these arguments.
set -eu
bundle=.bench-bundle
[ -f "$bundle/whl.tar.xz" ] && tar -C "$bundle" -xJf "$bundle/whl.tar.xz"  # the wheels run-bench.sh installs
[ -f "$bundle/hotpath312.tar.xz" ] && tar -m -xJf "$bundle/hotpath312.tar.xz"
[ -f "$bundle/before.tar.xz" ] && tar -m -C "$bundle" -xJf "$bundle/before.tar.xz"
# newer than their sources, whatever order the copy gave them (gatewayd/hotpath.py runs a build only then)
find gatewayd proxies "$bundle" -name '*.cpython-312-*.so' -exec touch {} +
exec bash "$bundle/run-bench.sh" "$@"
