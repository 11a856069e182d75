"""Pure codec for the MySQL client/server protocol (MySQL 5.7+, 8.x; MariaDB 10.x): bytes in, packets out.

No sockets: the asyncio server owns the I/O.  What is here:

* framing -- ``PacketReader`` turns bytes into logical packets (a payload of
  0xFFFFFF bytes is continued by the next packet: the pieces are joined, up
  to a bound), ``frame`` turns a payload back into packets with their
  sequence numbers (split again at 16 MB);
* the connection phase -- ``Handshake`` (v10, the server's greeting),
  ``HandshakeResponse`` (the client's, protocol 4.1), the scrambles of
  ``mysql_native_password`` and ``caching_sha2_password``;
* the command phase -- OK / ERR / EOF packets (with session state changes),
  column definitions, text and binary rows, COM_STMT_EXECUTE's parameters.

Integers are little-endian; "lenenc" is MySQL's length-encoded integer
(1, 3, 4 or 9 bytes).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field

# -- capability flags (``CLIENT_*``)
LONG_PASSWORD = 1
FOUND_ROWS = 2
LONG_FLAG = 4
CONNECT_WITH_DB = 8
NO_SCHEMA = 16
COMPRESS = 32
ODBC = 64
LOCAL_FILES = 128
IGNORE_SPACE = 256
PROTOCOL_41 = 512
INTERACTIVE = 1024
SSL = 2048
IGNORE_SIGPIPE = 4096
TRANSACTIONS = 8192
SECURE_CONNECTION = 1 << 15
MULTI_STATEMENTS = 1 << 16
MULTI_RESULTS = 1 << 17
PS_MULTI_RESULTS = 1 << 18
PLUGIN_AUTH = 1 << 19
CONNECT_ATTRS = 1 << 20
PLUGIN_AUTH_LENENC_CLIENT_DATA = 1 << 21
CAN_HANDLE_EXPIRED_PASSWORDS = 1 << 22
SESSION_TRACK = 1 << 23
DEPRECATE_EOF = 1 << 24
QUERY_ATTRIBUTES = 1 << 27

# -- server status flags
STATUS_IN_TRANS = 1
STATUS_AUTOCOMMIT = 2
MORE_RESULTS_EXISTS = 8
STATUS_CURSOR_EXISTS = 0x40
STATUS_LAST_ROW_SENT = 0x80
STATUS_NO_BACKSLASH_ESCAPES = 0x200
SESSION_STATE_CHANGED = 0x4000

# -- commands
COM_SLEEP, COM_QUIT, COM_INIT_DB, COM_QUERY, COM_FIELD_LIST = 0x00, 0x01, 0x02, 0x03, 0x04
COM_STATISTICS, COM_PROCESS_INFO, COM_PROCESS_KILL, COM_DEBUG, COM_PING = 0x09, 0x0A, 0x0C, 0x0D, 0x0E
COM_CHANGE_USER, COM_BINLOG_DUMP, COM_REGISTER_SLAVE = 0x11, 0x12, 0x15
COM_STMT_PREPARE, COM_STMT_EXECUTE, COM_STMT_SEND_LONG_DATA, COM_STMT_CLOSE = 0x16, 0x17, 0x18, 0x19
COM_STMT_RESET, COM_SET_OPTION, COM_STMT_FETCH, COM_RESET_CONNECTION = 0x1A, 0x1B, 0x1C, 0x1F

COMMAND_NAMES = {
    0x00: "COM_SLEEP", 0x01: "COM_QUIT", 0x02: "COM_INIT_DB", 0x03: "COM_QUERY", 0x04: "COM_FIELD_LIST",
    0x05: "COM_CREATE_DB", 0x06: "COM_DROP_DB", 0x07: "COM_REFRESH", 0x08: "COM_SHUTDOWN", 0x09: "COM_STATISTICS",
    0x0A: "COM_PROCESS_INFO", 0x0B: "COM_CONNECT", 0x0C: "COM_PROCESS_KILL", 0x0D: "COM_DEBUG", 0x0E: "COM_PING",
    0x0F: "COM_TIME", 0x10: "COM_DELAYED_INSERT", 0x11: "COM_CHANGE_USER", 0x12: "COM_BINLOG_DUMP",
    0x13: "COM_TABLE_DUMP", 0x14: "COM_CONNECT_OUT", 0x15: "COM_REGISTER_SLAVE", 0x16: "COM_STMT_PREPARE",
    0x17: "COM_STMT_EXECUTE", 0x18: "COM_STMT_SEND_LONG_DATA", 0x19: "COM_STMT_CLOSE", 0x1A: "COM_STMT_RESET",
    0x1B: "COM_SET_OPTION", 0x1C: "COM_STMT_FETCH", 0x1D: "COM_DAEMON", 0x1E: "COM_BINLOG_DUMP_GTID",
    0x1F: "COM_RESET_CONNECTION", 0xFA: "COM_STMT_BULK_EXECUTE",
}

# -- column types
T_DECIMAL, T_TINY, T_SHORT, T_LONG, T_FLOAT, T_DOUBLE, T_NULL, T_TIMESTAMP = 0, 1, 2, 3, 4, 5, 6, 7
T_LONGLONG, T_INT24, T_DATE, T_TIME, T_DATETIME, T_YEAR, T_NEWDATE, T_VARCHAR, T_BIT = 8, 9, 10, 11, 12, 13, 14, 15, 16
T_TIMESTAMP2, T_DATETIME2, T_TIME2 = 17, 18, 19
T_JSON, T_NEWDECIMAL, T_ENUM, T_SET = 245, 246, 247, 248
T_TINY_BLOB, T_MEDIUM_BLOB, T_LONG_BLOB, T_BLOB, T_VAR_STRING, T_STRING, T_GEOMETRY = 249, 250, 251, 252, 253, 254, 255
UNSIGNED_FLAG = 32
BINARY_CHARSET = 63
# column types whose values are text a masked text still reads as (strings, blobs of a text charset, enums, sets)
STRING_TYPES = frozenset((T_VARCHAR, T_VAR_STRING, T_STRING, T_TINY_BLOB, T_MEDIUM_BLOB, T_LONG_BLOB, T_BLOB,
                          T_ENUM, T_SET, T_JSON))
_FIXED_SIZES = {T_TINY: 1, T_SHORT: 2, T_YEAR: 2, T_LONG: 4, T_INT24: 4, T_FLOAT: 4, T_LONGLONG: 8, T_DOUBLE: 8,
                T_NULL: 0}
_DATE_TYPES = frozenset((T_DATE, T_DATETIME, T_TIMESTAMP, T_NEWDATE, T_TIMESTAMP2, T_DATETIME2))
_TIME_TYPES = frozenset((T_TIME, T_TIME2))

# the character set of each collation id a column definition names (MariaDB's information_schema.COLLATIONS; MySQL
# 8's own ids above 247 follow in ``charset_of``)
_COLLATIONS = {
    "armscii8": (32, 64, 1056, 1088), "ascii": (11, 65, 1035, 1089), "big5": (1, 84, 1025, 1108), "binary": (63,),
    "cp1250": (26, 34, 44, 66, 99, 1050, 1090), "cp1251": (14, 23, 50, 51, 52, 1074, 1075),
    "cp1256": (57, 67, 1081, 1091), "cp1257": (29, 58, 59, 1082, 1083), "cp850": (4, 80, 1028, 1104),
    "cp852": (40, 81, 1064, 1105), "cp866": (36, 68, 1060, 1092), "cp932": (95, 96, 1119, 1120),
    "dec8": (3, 69, 1027, 1093), "eucjpms": (97, 98, 1121, 1122), "euckr": (19, 85, 1043, 1109),
    "gb2312": (24, 86, 1048, 1110), "gbk": (28, 87, 1052, 1111), "geostd8": (92, 93, 1116, 1117),
    "greek": (25, 70, 1049, 1094), "hebrew": (16, 71, 1040, 1095), "hp8": (6, 72, 1030, 1096),
    "keybcs2": (37, 73, 1061, 1097), "koi8r": (7, 74, 1031, 1098), "koi8u": (22, 75, 1046, 1099),
    "latin1": (5, 8, 15, 31, 47, 48, 49, 94, 1032, 1071), "latin2": (2, 9, 21, 27, 77, 1033, 1101),
    "latin5": (30, 78, 1054, 1102), "latin7": (20, 41, 42, 79, 1065, 1103), "macce": (38, 43, 1062, 1067),
    "macroman": (39, 53, 1063, 1077), "sjis": (13, 88, 1037, 1112), "swe7": (10, 82, 1034, 1106),
    "tis620": (18, 89, 1042, 1113), "ujis": (12, 91, 1036, 1115), "utf16le": (56, 62, 1080, 1086),
    "ucs2": (35, 90, *range(128, 152), 159, 640, 641, 642, 1059, 1114, 1152, 1174),
    "utf16": (54, 55, *range(101, 125), 672, 673, 674, 1078, 1079, 1125, 1147),
    "utf32": (60, 61, *range(160, 184), 736, 737, 738, 1084, 1085, 1184, 1206),
    "utf8mb3": (33, 76, 83, *range(192, 216), 223, 576, 577, 578, 1057, 1107, 1216, 1238),
    "utf8mb4": (45, 46, *range(224, 248), 608, 609, 610, 1069, 1070, 1248, 1270),
}
CHARSETS = {number: name for name, numbers in _COLLATIONS.items() for number in numbers}


def charset_of(collation: int) -> str | None:
    """The character set of a collation id (a column definition's ``charset``), or None when not known."""
    name = CHARSETS.get(collation)
    if name is None and 248 <= collation <= 323:  # MySQL 8: gb18030, then the utf8mb4 0900 collations
        return "gb18030" if collation <= 250 else "utf8mb4" if collation >= 255 else None
    return name


MAX_PAYLOAD = 0xFFFFFF
DEFAULT_MAX_PACKET = 64 * 1024 * 1024  # a logical packet longer than this is refused ([mysql] max_packet_bytes)


class ProtocolError(Exception):
    """Malformed or unexpected input; ``message`` is safe to tell the peer."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


# --------------------------------------------------------------------------- integers and strings


def lenenc_int(value: int) -> bytes:
    if value < 251:
        return bytes((value,))
    if value < 1 << 16:
        return b"\xfc" + value.to_bytes(2, "little")
    if value < 1 << 24:
        return b"\xfd" + value.to_bytes(3, "little")
    return b"\xfe" + value.to_bytes(8, "little")


def lenenc_str(value: bytes) -> bytes:
    return lenenc_int(len(value)) + value


def read_lenenc(data: bytes, pos: int) -> tuple[int | None, int]:
    """(the integer, the position after it); None for 0xFB (NULL in a row).  ProtocolError past the end."""
    if pos >= len(data):
        raise ProtocolError("malformed packet: a length-encoded integer past its end")
    first = data[pos]
    if first < 251:
        return first, pos + 1
    if first == 251:
        return None, pos + 1
    size = {252: 2, 253: 3, 254: 8}.get(first)
    if size is None or pos + 1 + size > len(data):
        raise ProtocolError("malformed packet: a bad length-encoded integer")
    return int.from_bytes(data[pos + 1:pos + 1 + size], "little"), pos + 1 + size


def read_lenenc_str(data: bytes, pos: int) -> tuple[bytes | None, int]:
    size, pos = read_lenenc(data, pos)
    if size is None:
        return None, pos
    end = pos + size
    if end > len(data):
        raise ProtocolError("malformed packet: a string past its end")
    return data[pos:end], end


def read_nul_str(data: bytes, pos: int) -> tuple[bytes, int]:
    end = data.find(b"\0", pos)
    if end < 0:
        raise ProtocolError("malformed packet: a string without its NUL")
    return data[pos:end], end + 1


# --------------------------------------------------------------------------- framing


class PacketReader:
    """Bytes in, logical packets out: ``feed(data)``, then ``next_packet()`` until None.

    A logical packet is (its first sequence number, its last, its payload); pieces of 0xFFFFFF bytes are joined
    with what continues them.  A logical packet over ``limit`` bytes is a ProtocolError.
    """

    __slots__ = ("_buf", "_pieces", "_size", "_first", "limit")

    def __init__(self, limit: int = DEFAULT_MAX_PACKET) -> None:
        self._buf = bytearray()
        self._pieces: list[bytes] = []
        self._size = 0
        self._first = -1
        self.limit = limit

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def feed(self, data: bytes) -> None:
        self._buf += data

    def ready(self) -> bool:
        """Whether a whole packet is buffered."""
        buf = self._buf
        return len(buf) >= 4 and len(buf) >= 4 + (buf[0] | buf[1] << 8 | buf[2] << 16)

    def take_buffered(self) -> bytes:
        data = bytes(self._buf)
        self._buf.clear()
        return data

    def next_packet(self) -> tuple[int, int, bytes] | None:
        buf = self._buf
        while True:
            if len(buf) < 4:
                return None
            length = buf[0] | buf[1] << 8 | buf[2] << 16
            if len(buf) < 4 + length:
                if self._size + length > self.limit:
                    raise ProtocolError(f"a packet of more than {self.limit} bytes")
                return None
            seq = buf[3]
            payload = bytes(buf[4:4 + length])
            del buf[:4 + length]
            if self._first < 0:
                self._first = seq
            self._size += length
            if self._size > self.limit:
                raise ProtocolError(f"a packet of more than {self.limit} bytes")
            if length == MAX_PAYLOAD:
                self._pieces.append(payload)
                continue
            first = self._first
            if self._pieces:
                self._pieces.append(payload)
                payload = b"".join(self._pieces)
                self._pieces = []
            self._size = 0
            self._first = -1
            return first, seq, payload


def frame(payload: bytes, seq: int) -> tuple[bytes, int]:
    """``payload`` as packets from sequence number ``seq``: (the bytes, the next sequence number)."""
    size = len(payload)
    if size < MAX_PAYLOAD:
        return struct.pack("<I", size | (seq & 0xFF) << 24) + payload, (seq + 1) & 0xFF
    parts = []
    pos = 0
    while True:
        piece = payload[pos:pos + MAX_PAYLOAD]
        parts.append(struct.pack("<I", len(piece) | (seq & 0xFF) << 24))
        parts.append(piece)
        seq = (seq + 1) & 0xFF
        pos += MAX_PAYLOAD
        if len(piece) < MAX_PAYLOAD:
            return b"".join(parts), seq


# --------------------------------------------------------------------------- connection phase


@dataclass(slots=True)
class Handshake:
    """The server's greeting (HandshakeV10)."""

    server_version: str
    connection_id: int
    scramble: bytes  # 20 bytes
    capabilities: int
    charset: int = 45
    status: int = STATUS_AUTOCOMMIT
    plugin: str = "mysql_native_password"

    def encode(self) -> bytes:
        caps = self.capabilities
        return b"".join((
            b"\x0a", self.server_version.encode() + b"\0", struct.pack("<I", self.connection_id),
            self.scramble[:8], b"\0", struct.pack("<H", caps & 0xFFFF), bytes((self.charset,)),
            struct.pack("<H", self.status), struct.pack("<H", caps >> 16 & 0xFFFF), bytes((len(self.scramble) + 1,)),
            b"\0" * 10, self.scramble[8:] + b"\0", self.plugin.encode() + b"\0"))

    @classmethod
    def decode(cls, data: bytes) -> Handshake:
        if not data:
            raise ProtocolError("an empty greeting")
        if data[0] == 0xFF:
            raise ProtocolError(decode_err(data).message)
        if data[0] != 10:
            raise ProtocolError(f"protocol version {data[0]} (only version 10 is spoken)")
        try:
            version, pos = read_nul_str(data, 1)
            connection_id = struct.unpack_from("<I", data, pos)[0]
            part1 = data[pos + 4:pos + 12]
            pos += 13
            caps = struct.unpack_from("<H", data, pos)[0]
            charset = data[pos + 2]
            status = struct.unpack_from("<H", data, pos + 3)[0]
            caps |= struct.unpack_from("<H", data, pos + 5)[0] << 16
            auth_len = data[pos + 7]
            pos += 18
            part2_len = max(13, auth_len - 8)
            part2 = data[pos:pos + part2_len]
            pos += part2_len
            plugin = ""
            if caps & PLUGIN_AUTH and pos < len(data):
                name, _ = read_nul_str(data + b"\0", pos)
                plugin = name.decode()
        except (struct.error, IndexError) as exc:
            raise ProtocolError("a malformed greeting") from exc
        return cls(version.decode("utf-8", "replace"), connection_id, part1 + part2.rstrip(b"\0")[:12], caps,
                   charset, status, plugin or "mysql_native_password")


@dataclass(slots=True)
class HandshakeResponse:
    """The client's answer to the greeting (HandshakeResponse41), or its SSL request (``ssl_request``: cut short)."""

    capabilities: int
    max_packet: int = MAX_PAYLOAD
    charset: int = 45
    user: str = ""
    auth: bytes = b""
    database: str | None = None
    plugin: str = ""
    attributes: dict[str, str] = field(default_factory=dict)
    ssl_request: bool = False

    def encode(self) -> bytes:
        caps = self.capabilities
        parts = [struct.pack("<IIB", caps, self.max_packet, self.charset), b"\0" * 23]
        if self.ssl_request:
            return b"".join(parts)
        parts.append(self.user.encode() + b"\0")
        if caps & PLUGIN_AUTH_LENENC_CLIENT_DATA:
            parts.append(lenenc_str(self.auth))
        else:
            parts.append(bytes((len(self.auth),)) + self.auth)
        if caps & CONNECT_WITH_DB:
            parts.append((self.database or "").encode() + b"\0")
        if caps & PLUGIN_AUTH:
            parts.append(self.plugin.encode() + b"\0")
        if caps & CONNECT_ATTRS:
            attrs = b"".join(lenenc_str(k.encode()) + lenenc_str(v.encode()) for k, v in self.attributes.items())
            parts.append(lenenc_str(attrs))
        return b"".join(parts)

    @classmethod
    def decode(cls, data: bytes) -> HandshakeResponse:
        if len(data) < 32:
            raise ProtocolError("a malformed handshake response")
        caps, max_packet, charset = struct.unpack_from("<IIB", data)
        if not caps & PROTOCOL_41:
            raise ProtocolError("the client speaks the pre-4.1 protocol: not supported")
        if len(data) == 32:
            if not caps & SSL:
                raise ProtocolError("a handshake response without a user")
            return cls(caps, max_packet, charset, ssl_request=True)
        pos = 32
        user, pos = read_nul_str(data, pos)
        if caps & PLUGIN_AUTH_LENENC_CLIENT_DATA:
            auth, pos = read_lenenc_str(data, pos)
        elif caps & SECURE_CONNECTION:
            size = data[pos] if pos < len(data) else 0
            auth, pos = data[pos + 1:pos + 1 + size], pos + 1 + size
        else:
            auth, pos = read_nul_str(data, pos)
        database = None
        if caps & CONNECT_WITH_DB and pos < len(data):
            raw, pos = read_nul_str(data, pos)
            database = raw.decode("utf-8", "replace") or None
        plugin = ""
        if caps & PLUGIN_AUTH and pos < len(data):
            raw, pos = read_nul_str(data + b"\0", pos)
            plugin = raw.decode("utf-8", "replace")
        attributes: dict[str, str] = {}
        if caps & CONNECT_ATTRS and pos < len(data):
            raw, pos = read_lenenc_str(data, pos)
            at = 0
            raw = raw or b""
            while at < len(raw):
                key, at = read_lenenc_str(raw, at)
                value, at = read_lenenc_str(raw, at)
                attributes[(key or b"").decode("utf-8", "replace")] = (value or b"").decode("utf-8", "replace")
        return cls(caps, max_packet, charset, user.decode("utf-8", "replace"), auth or b"", database, plugin,
                   attributes)


def native_password(password: bytes, scramble: bytes) -> bytes:
    """``mysql_native_password``: SHA1(password) XOR SHA1(scramble + SHA1(SHA1(password)))."""
    if not password:
        return b""
    stage1 = hashlib.sha1(password).digest()
    stage2 = hashlib.sha1(stage1).digest()
    mix = hashlib.sha1(scramble[:20] + stage2).digest()
    return bytes(a ^ b for a, b in zip(stage1, mix))


def sha2_password(password: bytes, scramble: bytes) -> bytes:
    """``caching_sha2_password``'s fast answer: SHA256(password) XOR SHA256(SHA256(SHA256(password)) + scramble)."""
    if not password:
        return b""
    stage1 = hashlib.sha256(password).digest()
    stage2 = hashlib.sha256(stage1).digest()
    mix = hashlib.sha256(stage2 + scramble[:20]).digest()
    return bytes(a ^ b for a, b in zip(stage1, mix))


def xor_password(password: bytes, scramble: bytes) -> bytes:
    """The password (NUL-terminated) XOR the scramble: what ``caching_sha2_password`` encrypts with RSA."""
    data = password + b"\0"
    return bytes(b ^ scramble[i % len(scramble)] for i, b in enumerate(data))


# --------------------------------------------------------------------------- OK, ERR, EOF


@dataclass(slots=True)
class Ok:
    """An OK packet (or the OK that ends a result set under DEPRECATE_EOF, header 0xFE)."""

    affected_rows: int = 0
    last_insert_id: int = 0
    status: int = STATUS_AUTOCOMMIT
    warnings: int = 0
    info: bytes = b""
    changes: list[tuple[int, bytes]] = field(default_factory=list)  # session state changes: (type, data)
    header: int = 0

    def variables(self) -> dict[str, str]:
        """The system variables the server says changed (SESSION_TRACK_SYSTEM_VARIABLES)."""
        found: dict[str, str] = {}
        for kind, data in self.changes:
            if kind == 0:
                name, pos = read_lenenc_str(data, 0)
                value, _ = read_lenenc_str(data, pos)
                found[(name or b"").decode("utf-8", "replace").lower()] = (value or b"").decode("utf-8", "replace")
        return found

    def schema(self) -> str | None:
        for kind, data in self.changes:
            if kind == 1:
                name, _ = read_lenenc_str(data, 0)
                return (name or b"").decode("utf-8", "replace")
        return None

    def encode(self, session_track: bool = False) -> bytes:
        status = self.status
        parts = [bytes((self.header,)), lenenc_int(self.affected_rows), lenenc_int(self.last_insert_id)]
        if session_track and self.changes:
            parts += [struct.pack("<HH", status | SESSION_STATE_CHANGED, self.warnings), lenenc_str(self.info)]
            parts.append(lenenc_str(b"".join(bytes((kind,)) + lenenc_str(data) for kind, data in self.changes)))
        else:
            parts.append(struct.pack("<HH", status & ~SESSION_STATE_CHANGED, self.warnings))
            if self.info:
                parts.append(lenenc_str(self.info))
        return b"".join(parts)


def decode_ok(data: bytes, session_track: bool) -> Ok:
    try:
        affected, pos = read_lenenc(data, 1)
        insert_id, pos = read_lenenc(data, pos)
        status, warnings = struct.unpack_from("<HH", data, pos) if pos + 4 <= len(data) else (0, 0)
        pos += 4
        info = b""
        changes: list[tuple[int, bytes]] = []
        if pos < len(data):
            if session_track:
                raw, pos = read_lenenc_str(data, pos)
                info = raw or b""
                if status & SESSION_STATE_CHANGED and pos < len(data):
                    block, pos = read_lenenc_str(data, pos)
                    block = block or b""
                    at = 0
                    while at < len(block):
                        kind = block[at]
                        piece, at = read_lenenc_str(block, at + 1)
                        changes.append((kind, piece or b""))
            else:
                info = data[pos:]
                if info and info[0] < 251 and info[0] == len(info) - 1:
                    info = info[1:]  # sent length-encoded by the servers, though the protocol says "rest of packet"
    except struct.error as exc:
        raise ProtocolError("a malformed OK packet") from exc
    return Ok(affected or 0, insert_id or 0, status, warnings, info, changes, data[0])


@dataclass(slots=True)
class Err:
    code: int
    sqlstate: str
    message: str


def decode_err(data: bytes, encoding: str = "utf-8") -> Err:
    """An ERR packet; its message is in the session's ``character_set_results`` (``encoding``)."""
    if len(data) < 3:
        return Err(0, "HY000", "malformed error packet")
    code = struct.unpack_from("<H", data, 1)[0]
    if len(data) >= 9 and data[3:4] == b"#":
        return Err(code, data[4:9].decode("ascii", "replace"), data[9:].decode(encoding, "replace"))
    return Err(code, "HY000", data[3:].decode(encoding, "replace"))


def encode_err(code: int, sqlstate: str, message: str, encoding: str = "utf-8") -> bytes:
    return (b"\xff" + struct.pack("<H", code) + b"#" + sqlstate.encode()[:5].ljust(5, b"0")
            + message.encode(encoding, "replace"))


def encode_eof(status: int = STATUS_AUTOCOMMIT, warnings: int = 0) -> bytes:
    return b"\xfe" + struct.pack("<HH", warnings, status)


def eof_status(data: bytes) -> int:
    """The status flags of an EOF packet (0xFE, fewer than 9 bytes)."""
    return struct.unpack_from("<H", data, 3)[0] if len(data) >= 5 else 0


def is_ok(data: bytes) -> bool:
    return bool(data) and data[0] == 0


def is_err(data: bytes) -> bool:
    return bool(data) and data[0] == 0xFF


def is_eof(data: bytes) -> bool:
    """An EOF packet (a result's end without DEPRECATE_EOF)."""
    return bool(data) and data[0] == 0xFE and len(data) < 9


def is_end_ok(data: bytes) -> bool:
    """The OK that ends a result set under DEPRECATE_EOF (header 0xFE; a row starting so is 16 MB or more)."""
    return bool(data) and data[0] == 0xFE and len(data) < MAX_PAYLOAD


# --------------------------------------------------------------------------- result sets


@dataclass(slots=True)
class Column:
    """A column definition (Protocol::ColumnDefinition41)."""

    schema: str
    table: str
    org_table: str
    name: str
    org_name: str
    charset: int
    length: int
    type: int
    flags: int
    decimals: int
    encoding: str = "utf-8"  # of its names: the session's ``character_set_results`` (utf8 when NULL or binary)

    @property
    def textual(self) -> bool:
        """Its values are text a masked text still reads as (not numbers, dates, binary strings)."""
        return self.type in STRING_TYPES and (self.charset != BINARY_CHARSET or self.type == T_JSON)


def decode_column(data: bytes, encoding: str = "utf-8") -> Column:
    try:
        values = []
        pos = 0
        for _ in range(6):
            value, pos = read_lenenc_str(data, pos)
            values.append((value or b"").decode(encoding, "replace"))
        _, pos = read_lenenc(data, pos)
        charset, length, kind, flags, decimals = struct.unpack_from("<HIBHB", data, pos)
    except struct.error as exc:
        raise ProtocolError("a malformed column definition") from exc
    return Column(values[1], values[2], values[3], values[4], values[5], charset, length, kind, flags, decimals,
                  encoding)


def encode_column(column: Column) -> bytes:
    encoding = column.encoding
    return b"".join((lenenc_str("def".encode(encoding)), *(lenenc_str(v.encode(encoding, "replace")) for v in (
        column.schema, column.table, column.org_table, column.name, column.org_name)), b"\x0c",
        struct.pack("<HIBHB", column.charset, column.length, column.type, column.flags, column.decimals), b"\0\0"))


def decode_text_row(data: bytes, count: int) -> list[bytes | None]:
    values: list[bytes | None] = []
    pos = 0
    for _ in range(count):
        value, pos = read_lenenc_str(data, pos)
        values.append(value)
    if pos != len(data):
        raise ProtocolError("a malformed row: bytes after its last value")
    return values


def encode_text_row(values: list[bytes | None]) -> bytes:
    return b"".join(b"\xfb" if v is None else lenenc_str(v) for v in values)


def _binary_size(data: bytes, pos: int, kind: int) -> int:
    """Where the binary value of ``kind`` at ``pos`` ends."""
    size = _FIXED_SIZES.get(kind)
    if size is not None:
        return pos + size
    if kind in _DATE_TYPES or kind in _TIME_TYPES:
        if pos >= len(data):
            raise ProtocolError("a malformed binary row")
        return pos + 1 + data[pos]
    length, at = read_lenenc(data, pos)
    return at + (length or 0)


def decode_binary_row(data: bytes, columns: list[Column]) -> list[bytes | None]:
    """A binary-protocol row's values, each as its raw bytes (``binary_text`` renders them)."""
    count = len(columns)
    bitmap_size = (count + 7 + 2) // 8
    if not data or data[0] != 0 or len(data) < 1 + bitmap_size:
        raise ProtocolError("a malformed binary row")
    bitmap = data[1:1 + bitmap_size]
    pos = 1 + bitmap_size
    values: list[bytes | None] = []
    for i, column in enumerate(columns):
        bit = i + 2
        if bitmap[bit >> 3] & (1 << (bit & 7)):
            values.append(None)
            continue
        end = _binary_size(data, pos, column.type)
        if end > len(data):
            raise ProtocolError("a malformed binary row")
        values.append(data[pos:end])
        pos = end
    if pos != len(data):
        raise ProtocolError("a malformed binary row: bytes after its last value")
    return values


def encode_binary_row(values: list[bytes | None]) -> bytes:
    """A binary row of raw values (each as ``decode_binary_row`` gave it), NULLs in the bitmap."""
    count = len(values)
    bitmap = bytearray((count + 7 + 2) // 8)
    for i, value in enumerate(values):
        if value is None:
            bit = i + 2
            bitmap[bit >> 3] |= 1 << (bit & 7)
    return b"\0" + bytes(bitmap) + b"".join(v for v in values if v is not None)


def binary_string(value: bytes) -> bytes:
    """A string value of the binary protocol (length-encoded) as its bytes."""
    text, _ = read_lenenc_str(value, 0)
    return text or b""


def binary_text(kind: int, flags: int, value: bytes) -> str:
    """A binary-protocol value as text, as the text protocol would send it."""
    unsigned = bool(flags & UNSIGNED_FLAG)
    if kind == T_TINY:
        return str(value[0] if unsigned else struct.unpack("<b", value)[0])
    if kind in (T_SHORT, T_YEAR):
        return str(struct.unpack("<H" if unsigned or kind == T_YEAR else "<h", value)[0])
    if kind in (T_LONG, T_INT24):
        return str(struct.unpack("<I" if unsigned else "<i", value)[0])
    if kind == T_LONGLONG:
        return str(struct.unpack("<Q" if unsigned else "<q", value)[0])
    if kind == T_FLOAT:
        return repr(struct.unpack("<f", value)[0])
    if kind == T_DOUBLE:
        return repr(struct.unpack("<d", value)[0])
    if kind in _DATE_TYPES:
        n = value[0]
        year, month, day = (struct.unpack_from("<HBB", value, 1) if n >= 4 else (0, 0, 0))
        text = f"{year:04d}-{month:02d}-{day:02d}"
        if n >= 7:
            hour, minute, second = value[5], value[6], value[7]
            text += f" {hour:02d}:{minute:02d}:{second:02d}"
            if n >= 11:
                text += f".{struct.unpack_from('<I', value, 8)[0]:06d}"
        return text
    if kind in _TIME_TYPES:
        n = value[0]
        if n < 8:
            return "00:00:00"
        negative, days = value[1], struct.unpack_from("<I", value, 2)[0]
        hours = days * 24 + value[6]
        text = f"{'-' if negative else ''}{hours:02d}:{value[7]:02d}:{value[8]:02d}"
        if n >= 12:
            text += f".{struct.unpack_from('<I', value, 9)[0]:06d}"
        return text
    raw = binary_string(value)
    return raw.decode("utf-8", "replace")


# --------------------------------------------------------------------------- prepared statements


@dataclass(slots=True)
class PrepareOk:
    statement_id: int
    columns: int
    params: int
    warnings: int


def decode_prepare_ok(data: bytes) -> PrepareOk:
    if len(data) < 12 or data[0] != 0:
        raise ProtocolError("a malformed COM_STMT_PREPARE answer")
    statement_id, columns, params, _, warnings = struct.unpack_from("<IHHBH", data, 1)
    return PrepareOk(statement_id, columns, params, warnings)


def decode_execute(data: bytes, params: int, types: list[tuple[int, int]] | None,
                   long_data: dict[int, bytes]) -> tuple[int, list[tuple[int, int]] | None, list[bytes | str | None]]:
    """COM_STMT_EXECUTE: (its statement id, the parameter types it binds or those given before, each parameter's
    value: None for NULL, bytes for a string or blob, text for a number or a date)."""
    try:
        return _decode_execute(data, params, types, long_data)
    except (IndexError, struct.error, ValueError) as exc:
        raise ProtocolError("a malformed COM_STMT_EXECUTE") from exc


def _decode_execute(data: bytes, params: int, types: list[tuple[int, int]] | None,
                    long_data: dict[int, bytes]) -> tuple[int, list[tuple[int, int]] | None, list[bytes | str | None]]:
    if len(data) < 10:
        raise ProtocolError("a malformed COM_STMT_EXECUTE")
    statement_id = struct.unpack_from("<I", data, 1)[0]
    if not params:
        return statement_id, types, []
    pos = 10
    bitmap_size = (params + 7) // 8
    bitmap = data[pos:pos + bitmap_size]
    pos += bitmap_size
    if pos >= len(data):
        raise ProtocolError("a malformed COM_STMT_EXECUTE")
    if data[pos] == 1:
        pos += 1
        types = [(data[pos + 2 * i], data[pos + 2 * i + 1]) for i in range(params)]
        pos += 2 * params
    else:
        pos += 1
    if types is None or len(types) != params:
        raise ProtocolError("COM_STMT_EXECUTE without its parameters' types")
    values: list[bytes | str | None] = []
    for i in range(params):
        if len(bitmap) > i >> 3 and bitmap[i >> 3] & (1 << (i & 7)):
            values.append(None)
            continue
        if i in long_data:
            values.append(long_data[i])
            continue
        kind, flag = types[i]
        end = _binary_size(data, pos, kind)
        if end > len(data):
            raise ProtocolError("a malformed COM_STMT_EXECUTE: a parameter past its end")
        raw = data[pos:end]
        pos = end
        if kind in _FIXED_SIZES or kind in _DATE_TYPES or kind in _TIME_TYPES:
            values.append(binary_text(kind, UNSIGNED_FLAG if flag & 0x80 else 0, raw))
        else:
            values.append(binary_string(raw))
    return statement_id, types, values
