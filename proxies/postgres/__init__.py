"""PostgreSQL proxy: a pure v3 wire-protocol codec (``codec``) and, beside it, the asyncio server.

The codec turns bytes into message objects and back without touching a
socket, so every edge case is a unit test and the framers can be fuzzed.
"""
