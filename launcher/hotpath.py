"""``python -m launcher.hotpath build | list | status``: the compiled hot path (gatewayd.hotpath), every protocol
registered first, so that a build compiles each protocol's own modules (its description's ``compiled``)."""

from __future__ import annotations

import sys

import proxies  # noqa: F401  registers every protocol's description (and so its hot-path modules)
from gatewayd import hotpath

if __name__ == "__main__":
    sys.exit(hotpath.main(sys.argv[1:]))
