"""The ``gatewayd`` command's composition root: the only package that knows the core, the proxies and the API.

Layers (tests/test_layers.py, ``[tool.importlinter]`` in pyproject.toml):
``launcher`` > ``proxies`` | ``control`` (independent of each other) > ``gatewayd``.
"""
