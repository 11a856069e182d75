"""gatewayd: an access gateway for databases and servers."""

from gatewayd import hotpath

__version__ = "0.1.0"

hotpath.install()  # before any module of the compiled hot path is imported (gatewayd/hotpath.py)
