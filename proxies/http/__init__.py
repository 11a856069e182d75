"""HTTP proxy: internal web apps and APIs through the gateway (``messages`` pure logic, ``server`` I/O)."""
