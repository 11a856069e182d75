"""gatewayd: an access gateway for databases and servers."""

__version__ = "0.1.0"
