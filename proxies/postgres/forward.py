"""A proxy manager's local PostgreSQL client, forwarded: its start-up message carries the user's credential.

psql on the user's machine connects to the proxy manager's local port with any user name; the
gateway reads the opening here, declines SSL/GSS encryption (the bytes travel inside the
proxy manager's TLS channel already), and hands its own PostgreSQL listener the start-up message
with the credential secret as ``user`` (and, where libpq defaulted the database to the user name,
the secret there too, so that the role's ``DB`` is taken).
"""

from __future__ import annotations

import asyncio
import struct

SSL_REQUEST, GSSENC_REQUEST, CANCEL_REQUEST = 80877103, 80877104, 80877102
MAX_STARTUP = 10_000


async def opening(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: str) -> bytes:
    """The start-up message to send on, with ``secret`` as its user; ValueError for anything else."""
    while True:
        length, code = struct.unpack("!II", await reader.readexactly(8))
        if not 8 <= length <= MAX_STARTUP:
            raise ValueError("not a PostgreSQL start-up message")
        body = await reader.readexactly(length - 8)
        if code in (SSL_REQUEST, GSSENC_REQUEST):
            writer.write(b"N")
            await writer.drain()
            continue
        if code >> 16 != 3:
            raise ValueError("only a protocol 3 start-up is forwarded")
        words = body.split(b"\0")
        parameters = dict(zip(words[0::2], words[1::2]))
        parameters.pop(b"", None)
        user = parameters.get(b"user", b"")
        if parameters.get(b"database", user) == user:
            parameters[b"database"] = secret.encode()  # libpq's default: the proxy then takes the role's DB
        parameters[b"user"] = secret.encode()
        body = b"".join(k + b"\0" + v + b"\0" for k, v in parameters.items()) + b"\0"
        return struct.pack("!II", len(body) + 8, code) + body
