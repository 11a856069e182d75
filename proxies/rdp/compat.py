"""pyrdp-mitm 2.1.0 on the Pythons the gateway supports: the one shim it needs, applied before pyrdp is imported.

pyrdp-mitm 2.1.0 (its last release) does ``from typing import io`` in
``pyrdp/mitm/FileMapping.py``, which every ``pyrdp.mitm`` import reaches.
``typing.io`` was deprecated in Python 3.8 and removed in 3.13, where that
line raises ImportError. ``typing.io`` was only a namespace holding
``typing.IO``, ``TextIO`` and ``BinaryIO``; pyrdp uses it for annotations
(``io.BinaryIO``). On 3.13 and later the same namespace is put back, made of
those same three names; on earlier Pythons nothing is touched.

``proxies.rdp`` applies it when imported, so it runs before ``codec`` and
``mitm`` import pyrdp. Anything that imports pyrdp without ``proxies.rdp``
(pyrdp's own ``pyrdp-mitm`` command, say) must import ``proxies.rdp`` first.
Remove this module when pyrdp no longer imports ``typing.io``.
"""

from __future__ import annotations

import types
import typing


def apply() -> None:
    """Give ``typing`` its ``io`` namespace back where this Python removed it (3.13+)."""
    if not hasattr(typing, "io"):
        typing.io = types.SimpleNamespace(  # type: ignore[attr-defined]
            __name__="typing.io", IO=typing.IO, TextIO=typing.TextIO, BinaryIO=typing.BinaryIO)
