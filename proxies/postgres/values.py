"""PostgreSQL values in binary format: what their bytes say, for the masker and the recording.

A client may ask for any result column in binary format (asyncpg always does,
psycopg 3 with ``binary=True``, pgjdbc with ``binaryTransferEnable``).  The
masker reads text, so each binary value is turned into the text the server
would have sent (near enough for a pattern to find what is in it: the same
digits, the same strings), and a masked value is encoded back in binary so
the client still parses it.

Containers hold other values, each with its own type: an array's header names
its element type, a record (and a composite, which is sent as one) names each
field's type; a range's bounds are of its subtype, a multirange holds ranges,
a domain is sent as its base type.  Ranges, multiranges, domains and the types
a database defines itself are known by OID only through the catalog
(``TypeShapes.from_catalog``, fed by proxies/postgres/catalog.py); the
built-in ones are known here.  Masking walks a container down to its leaves:

* a text leaf (``text``, ``varchar``, ``bpchar``, ``name``, ``xml``, an enum's
  label, ``citext``...) gets the masked string;
* a ``json``/``jsonb`` leaf gets it while it stays JSON, else NULL;
* any other leaf (numbers, dates, addresses...) whose text a pattern matches
  becomes NULL (an array element or a record field may be NULL);
* a range or multirange with a matched bound becomes NULL as a whole (a bound
  cannot be NULL), as does every value masked whole but a text or JSON one.

A value whose type is not known, or whose bytes do not follow its type's
format, raises ``Undecodable``: the caller withholds it (fail closed).
"""

from __future__ import annotations

import ipaddress
import json
import re
import struct
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import TYPE_CHECKING, Callable, Iterable

if TYPE_CHECKING:
    from gatewayd.masking import Masker

__all__ = ["ARRAY", "DOMAIN", "JSON", "JSONB", "MULTIRANGE", "RANGE", "RECORD", "SCALAR", "TEXT", "TypeShapes",
           "Undecodable", "BUILTIN_SHAPES", "mask_binary", "render", "render_binary"]

# kinds of binary format
TEXT = 1  # UTF-8 text as it is
JSON = 2  # JSON text
JSONB = 3  # a version byte (1), then JSON text
SCALAR = 4  # a value of a known type that holds no free text: rendered to be searched, masked to NULL
ARRAY = 5  # array_send: the element type is in the value
RECORD = 6  # record_send (records and composites): each field's type is in the value
RANGE = 7  # range_send: flags and bounds of the range's subtype (the shape's link)
MULTIRANGE = 8  # multirange_send: ranges of the range type (the link)
DOMAIN = 9  # sent as its base type (the link)

FIRST_MADE_OID = 10000  # types from this OID on are made by initdb or later (catalog.TYPES_QUERY lists them all)
MAX_DEPTH = 32  # containers nested deeper than this are not read (withheld)
MAX_ITEMS = 1 << 16  # an array (a record, a multirange) holding more values is not read either: too long to mask
MAX_MATCHES = 1000  # nor one where the patterns find more values


class Undecodable(ValueError):
    """A binary value the masker cannot read: an unknown type, or bytes not in its type's format."""


_EPOCH_2000 = datetime(2000, 1, 1, tzinfo=UTC)
_I16 = struct.Struct("!h")
_U16 = struct.Struct("!H")
_I32 = struct.Struct("!i")
_U32 = struct.Struct("!I")
_I64 = struct.Struct("!q")
_U64 = struct.Struct("!Q")
_F32 = struct.Struct("!f")
_F64 = struct.Struct("!d")
_BOOL = struct.Struct("!?")
_FIELD_HEAD = struct.Struct("!Ii")
_ARRAY_1 = struct.Struct("!iiIii")  # a one-dimension array's header: dimensions, flags, element type, size, lower bound  # a record field's type and length
_INT_MAX64, _INT_MIN64 = (1 << 63) - 1, -(1 << 63)


_FLOAT_WORDS = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def _float8(raw: bytes) -> str:
    text = repr(_F64.unpack(raw)[0])
    return _FLOAT_WORDS.get(text, text)


def _float(value: float) -> str:
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "Infinity" if value > 0 else "-Infinity"
    return repr(value)


def _float4(raw: bytes) -> str:
    value = _F32.unpack(raw)[0]
    if value != value or value in (float("inf"), float("-inf")):
        return _float(value)
    for digits in range(1, 10):  # the shortest text that reads back as the same float4, as PostgreSQL prints it
        text = f"{value:.{digits}g}"
        if _F32.pack(float(text)) == raw:
            return text
    return repr(value)


def _numeric(raw: bytes) -> str:
    ndigits, weight, sign, dscale = struct.unpack_from("!hhHh", raw)
    if len(raw) != 8 + 2 * ndigits or ndigits < 0:
        raise ValueError("numeric digits")
    if sign == 0xC000:
        return "NaN"
    if sign in (0xD000, 0xF000):
        return "Infinity" if sign == 0xD000 else "-Infinity"
    value = Decimal(0)
    for i, digit in enumerate(struct.unpack_from(f"!{ndigits}H", raw, 8)):
        value += Decimal(digit).scaleb(4 * (weight - i))
    return f"{-value if sign == 0x4000 else value:.{max(dscale, 0)}f}"


def _timestamp(raw: bytes, zoned: bool) -> str:
    micros = _I64.unpack(raw)[0]
    if micros in (_INT_MAX64, _INT_MIN64):
        return "infinity" if micros > 0 else "-infinity"
    try:
        moment = _EPOCH_2000 + timedelta(microseconds=micros)
    except OverflowError:
        return str(micros)  # beyond Python's years: its digits
    return moment.isoformat(sep=" ") if zoned else moment.replace(tzinfo=None).isoformat(sep=" ")


def _date(raw: bytes) -> str:
    days = _I32.unpack(raw)[0]
    if days in (0x7FFFFFFF, -0x80000000):
        return "infinity" if days > 0 else "-infinity"
    try:
        return (_EPOCH_2000 + timedelta(days=days)).date().isoformat()
    except OverflowError:
        return str(days)


def _clock(micros: int) -> str:
    sign = "-" if micros < 0 else ""
    micros = abs(micros)
    seconds, fraction = divmod(micros, 1_000_000)
    text = f"{sign}{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
    return text + f".{fraction:06d}".rstrip("0") if fraction else text


def _timetz(raw: bytes) -> str:
    if len(raw) != 12:
        raise ValueError("timetz size")
    micros, zone = struct.unpack("!qi", raw)
    offset = -zone  # seconds west of UTC
    sign = "+" if offset >= 0 else "-"
    offset = abs(offset)
    zone_text = f"{sign}{offset // 3600:02d}" + (f":{offset // 60 % 60:02d}" if offset % 3600 else "")
    return _clock(micros) + zone_text


def _interval(raw: bytes) -> str:
    if len(raw) != 16:
        raise ValueError("interval size")
    micros, days, months = struct.unpack("!qii", raw)
    parts = []
    years, months = int(months / 12), months - int(months / 12) * 12
    for count, unit in ((years, "year"), (months, "mon"), (days, "day")):
        if count:
            parts.append(f"{count} {unit}{'' if abs(count) == 1 else 's'}")
    if micros or not parts:
        parts.append(_clock(micros))
    return " ".join(parts)


def _inet(raw: bytes) -> str:
    if len(raw) < 4:
        raise ValueError("inet size")
    family, bits, is_cidr, size = raw[0], raw[1], raw[2], raw[3]
    address = raw[4:]
    if len(address) != size or family not in (2, 3) or size != (4 if family == 2 else 16):
        raise ValueError("inet address")
    ip = ipaddress.ip_address(address)
    full = 32 if family == 2 else 128
    return f"{ip}/{bits}" if is_cidr or bits != full else str(ip)


def _bits(raw: bytes) -> str:
    length = _I32.unpack_from(raw)[0]
    data = raw[4:]
    if length < 0 or len(data) != (length + 7) // 8:
        raise ValueError("bit string size")
    return "".join("1" if data[i // 8] & (0x80 >> i % 8) else "0" for i in range(length))


def _points(raw: bytes, count: int, at: int = 0) -> str:
    if len(raw) != at + 16 * count:
        raise ValueError("geometric size")
    values = struct.unpack_from(f"!{2 * count}d", raw, at)
    return ",".join(f"({_float(values[i])},{_float(values[i + 1])})" for i in range(0, 2 * count, 2))


def _path(raw: bytes) -> str:
    closed, count = raw[0], _I32.unpack_from(raw, 1)[0]
    text = _points(raw, count, 5)
    return f"({text})" if closed else f"[{text}]"


def _polygon(raw: bytes) -> str:
    return f"({_points(raw, _I32.unpack_from(raw)[0], 4)})"


def _floats(raw: bytes, count: int) -> list[str]:
    if len(raw) != 8 * count:
        raise ValueError("geometric size")
    return [_float(v) for v in struct.unpack(f"!{count}d", raw)]


def _tsvector(raw: bytes) -> str:
    count, pos = _I32.unpack_from(raw)[0], 4
    words = []
    for _ in range(count):
        end = raw.index(b"\0", pos)
        word = raw[pos:end].decode("utf-8", "replace").replace("'", "''")
        positions = _U16.unpack_from(raw, end + 1)[0]
        pos = end + 3 + 2 * positions
        found = struct.unpack_from(f"!{positions}H", raw, end + 3)
        words.append(f"'{word}'" + (":" + ",".join(str(p & 0x3FFF) for p in found) if found else ""))
    if pos != len(raw):
        raise ValueError("tsvector size")
    return " ".join(words)


def _tsquery(raw: bytes) -> str:
    """The operands of a tsquery, quoted, in order (its operators are not needed to find what it holds)."""
    count, pos = _I32.unpack_from(raw)[0], 4
    operands = []
    for _ in range(count):
        kind = raw[pos]
        if kind == 1:  # an operand: weight, prefix, then the text
            end = raw.index(b"\0", pos + 3)
            operands.append("'" + raw[pos + 3:end].decode("utf-8", "replace").replace("'", "''") + "'")
            pos = end + 1
        elif kind == 2:  # an operator: its code, and a distance for <->
            pos += 4 if raw[pos + 1] == 4 else 2
        else:
            raise ValueError("tsquery item")
    if pos != len(raw):
        raise ValueError("tsquery size")
    return " ".join(operands)


def _snapshot(raw: bytes) -> str:
    count = _I32.unpack_from(raw)[0]
    if count < 0 or len(raw) != 20 + 8 * count:
        raise ValueError("snapshot size")
    xmin, xmax, *running = struct.unpack_from(f"!qq{count}q", raw, 4)
    return f"{xmin}:{xmax}:" + ",".join(map(str, running))


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "replace")


def _struct(packer: struct.Struct) -> Callable[[bytes], str]:
    unpack = packer.unpack  # it checks the size: struct.error otherwise
    return lambda raw: str(unpack(raw)[0])


# scalar types that hold no free text: how their binary value reads as text
_RENDERERS: dict[int, Callable[[bytes], str]] = {
    18: _text,  # "char": one byte, which a masked string would not fit
    16: lambda raw: "t" if _BOOL.unpack(raw)[0] else "f",
    17: lambda raw: "\\x" + raw.hex(),  # bytea, as the server's default bytea_output prints it
    20: _struct(_I64), 21: _struct(_I16), 23: _struct(_I32), 5069: _struct(_U64),
    **{oid: _struct(_U32) for oid in (24, 26, 28, 29, 2202, 2203, 2204, 2205, 2206, 3734, 3769, 4089, 4096, 4191)},
    27: lambda raw: "({},{})".format(*struct.unpack("!IH", raw)) if len(raw) == 6 else _fail("tid size"),
    700: _float4, 701: _float8,
    1700: _numeric,
    1082: _date, 1083: lambda raw: _clock(_I64.unpack(raw)[0]), 1266: _timetz,
    1114: lambda raw: _timestamp(raw, False), 1184: lambda raw: _timestamp(raw, True),
    1186: _interval,
    2950: lambda raw: str(uuid.UUID(bytes=raw)),
    790: lambda raw: "{}{}.{:02d}".format("-" if (v := _I64.unpack(raw)[0]) < 0 else "", abs(v) // 100, abs(v) % 100),
    650: _inet, 869: _inet,
    829: lambda raw: ":".join(f"{b:02x}" for b in raw) if len(raw) == 6 else _fail("macaddr size"),
    774: lambda raw: ":".join(f"{b:02x}" for b in raw) if len(raw) == 8 else _fail("macaddr8 size"),
    1560: _bits, 1562: _bits,
    3220: lambda raw: "{:X}/{:X}".format(*divmod(_U64.unpack(raw)[0], 1 << 32)),
    600: lambda raw: _points(raw, 1), 601: lambda raw: f"[{_points(raw, 2)}]", 603: lambda raw: _points(raw, 2),
    602: _path, 604: _polygon,
    628: lambda raw: "{{{}}}".format(",".join(_floats(raw, 3))),
    718: lambda raw: "<({},{}),{}>".format(*_floats(raw, 3)),
    3614: _tsvector, 3615: _tsquery,
    2970: _snapshot, 5038: _snapshot,
    4072: lambda raw: raw[1:].decode("utf-8", "replace") if raw[:1] == b"\x01" else _fail("jsonpath version"),
}


def _fail(why: str) -> str:
    raise ValueError(why)


_TEXT_TYPES = (19, 25, 142, 705, 1042, 1043, 1790, 2275)  # name, text, xml, unknown, bpchar, varchar, refcursor, cstring
# built-in arrays (array OID -> element OID, from pg_type.dat: fixed OIDs below 10000)
_BUILTIN_ARRAYS = (
    143, 199, 210, 270, 271, 272, 273, 629, 651, 719, 775, 791, 1000, 1001, 1002, 1003, 1005, 1006, 1007, 1008, 1009,
    1010, 1011, 1012, 1013, 1014, 1015, 1016, 1017, 1018, 1019, 1020, 1021, 1022, 1027, 1028, 1040, 1041, 1115,
    1182, 1183, 1185, 1187, 1231, 1263, 1270, 1561, 1563, 2201, 2207, 2208, 2209, 2210, 2211, 2287, 2949, 2951,
    3221, 3643, 3645, 3735, 3770, 3807, 3905, 3907, 3909, 3911, 3913, 3927, 4073, 4090, 4097, 4192, 5039, 6150,
    6151, 6152, 6153, 6155, 6157,
    22, 30,  # int2vector, oidvector: sent as arrays
)
_BUILTIN_RANGES = {3904: 23, 3906: 1700, 3908: 1114, 3910: 1184, 3912: 1082, 3926: 20}
_BUILTIN_MULTIRANGES = {4451: 3904, 4532: 3906, 4533: 3908, 4534: 3910, 4535: 3912, 4536: 3926}
_BUILTIN_RECORDS = (2249, 71, 75, 81, 83, 1248, 2842, 2843, 4066, 6101)  # record, and the fixed catalog row types

BUILTIN_SHAPES: dict[int, tuple[int, int]] = {
    **{oid: (TEXT, 0) for oid in _TEXT_TYPES},
    114: (JSON, 0), 3802: (JSONB, 0),
    **{oid: (SCALAR, 0) for oid in _RENDERERS},
    **{oid: (ARRAY, 0) for oid in _BUILTIN_ARRAYS},
    **{oid: (RANGE, sub) for oid, sub in _BUILTIN_RANGES.items()},
    **{oid: (MULTIRANGE, rng) for oid, rng in _BUILTIN_MULTIRANGES.items()},
    **{oid: (RECORD, 0) for oid in _BUILTIN_RECORDS},
}
_TEXT_SEND = frozenset(("textsend", "varcharsend", "bpcharsend"))  # a type sent as text (citext's send is textsend)


def _jsonb_text(raw: bytes) -> str:
    if raw[:1] != b"\x01":
        raise ValueError("jsonb version")
    return raw[1:].decode("utf-8", "replace")


# every built-in single value: how its binary format reads as text (the first thing ``render`` tries)
_LEAVES: dict[int, Callable[[bytes], str]] = {
    **dict.fromkeys(_TEXT_TYPES, _text), 114: _text, 3802: _jsonb_text, **_RENDERERS}


_RAW_TEXT = frozenset((*_TEXT_TYPES, 114))  # their bytes are their text


class TypeShapes:
    """What the masker knows of each type's binary format: the built-in types, and the target database's own
    (``from_catalog``).  ``shape(oid)``: (kind, link) or None when unknown."""

    __slots__ = ("_listed", "_shapes", "complete")

    def __init__(self, shapes: dict[int, tuple[int, int]] | None = None, complete: bool = False,
                 listed: frozenset[int] = frozenset()) -> None:
        self._shapes = BUILTIN_SHAPES if shapes is None else shapes
        self.complete = complete  # the target's catalog was read (else only the built-in types are known)
        self._listed = listed  # the types the catalog listed that have no shape here (an extension's own format)

    @classmethod
    def from_catalog(cls, rows: Iterable[tuple[int, str, int, int, int, str | None]]) -> TypeShapes:
        """From rows of (OID, typtype, typbasetype, range subtype, multirange's range, the send function's
        internal name) -- ``catalog.TYPES_QUERY``'s."""
        shapes = dict(BUILTIN_SHAPES)
        listed: set[int] = set()
        for oid, typtype, base, subtype, range_type, send in rows:
            listed.add(oid)
            if oid in BUILTIN_SHAPES:
                continue
            if typtype == "d" and base:
                shapes[oid] = (DOMAIN, base)
            elif typtype == "c":
                shapes[oid] = (RECORD, 0)
            elif typtype == "e":
                shapes[oid] = (TEXT, 0)
            elif typtype == "r" and subtype:
                shapes[oid] = (RANGE, subtype)
            elif typtype == "m" and range_type:
                shapes[oid] = (MULTIRANGE, range_type)
            elif send == "array_send":
                shapes[oid] = (ARRAY, 0)
            elif send in _TEXT_SEND:
                shapes[oid] = (TEXT, 0)
        return cls(shapes, complete=True, listed=frozenset(listed.difference(shapes)))

    def shape(self, oid: int) -> tuple[int, int] | None:
        return self._shapes.get(oid)

    def knows(self, oid: int) -> bool:
        return oid in self._shapes

    def made_since(self, oid: int) -> bool:
        """Whether ``oid`` is a type the database made after its catalog was read (``catalog.TYPES_QUERY`` lists
        every type from OID 10000 on: below, initdb's own)."""
        return self.complete and oid >= FIRST_MADE_OID and oid not in self._shapes and oid not in self._listed

    def leaf(self, oid: int) -> bool:
        """Whether a binary value of ``oid`` is one value (text, JSON, a scalar), not a container to walk."""
        found = self._shapes.get(oid)
        return found is not None and found[0] <= SCALAR


BUILTIN = TypeShapes()


# -- reading

class _Reader:
    __slots__ = ("raw", "pos")

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        self.pos = 0

    def i32(self) -> int:
        if self.pos + 4 > len(self.raw):
            raise Undecodable("a value ends early")
        value = _I32.unpack_from(self.raw, self.pos)[0]
        self.pos += 4
        return value

    def u32(self) -> int:
        return self.i32() & 0xFFFFFFFF

    def byte(self) -> int:
        if self.pos >= len(self.raw):
            raise Undecodable("a value ends early")
        self.pos += 1
        return self.raw[self.pos - 1]

    def value(self) -> bytes | None:
        n = self.i32()
        if n < 0:
            if n != -1:
                raise Undecodable("a negative length")
            return None
        if self.pos + n > len(self.raw):
            raise Undecodable("a value ends early")
        self.pos += n
        return self.raw[self.pos - n:self.pos]

    def done(self) -> None:
        if self.pos != len(self.raw):
            raise Undecodable("bytes after the value")


def _items(raw: bytes, pos: int, count: int) -> list[bytes | None]:
    """``count`` length-prefixed values from ``pos`` on, which must end ``raw``."""
    items: list[bytes | None] = []
    end = len(raw)
    unpack = _I32.unpack_from
    for _ in range(count):
        if pos + 4 > end:
            raise Undecodable("a value ends early")
        n = unpack(raw, pos)[0]
        pos += 4
        if n < 0:
            if n != -1:
                raise Undecodable("a negative length")
            items.append(None)
        else:
            if pos + n > end:
                raise Undecodable("a value ends early")
            items.append(raw[pos:pos + n])
            pos += n
    if pos != end:
        raise Undecodable("bytes after the value")
    return items


def _array(raw: bytes) -> tuple[int, list[tuple[int, int]], list[bytes | None]]:
    """(element type, [(size, lower bound)] per dimension, elements) of an array_send value."""
    if len(raw) >= 20:  # the usual array, of one dimension: its header read at once
        ndim, _, elem, size, lower = _ARRAY_1.unpack_from(raw)
        if ndim == 1:
            if not 0 <= size <= len(raw):  # every element takes 4 bytes at least
                raise Undecodable("array size")
            if size > MAX_ITEMS:
                raise Undecodable(f"more than {MAX_ITEMS} values in an array, too many to mask")
            return elem, [(size, lower)], _items(raw, 20, size)
    if len(raw) < 12:
        raise Undecodable("a value ends early")
    ndim, _, elem = struct.unpack_from("!iiI", raw)
    if not 0 <= ndim <= 6 or len(raw) < 12 + 8 * ndim:
        raise Undecodable("array dimensions")
    flat = struct.unpack_from(f"!{2 * ndim}i", raw, 12)
    dims = [(flat[i], flat[i + 1]) for i in range(0, 2 * ndim, 2)]
    count = 1 if dims else 0
    for size, _ in dims:
        if size < 0:
            raise Undecodable("array size")
        count *= size
    if count > len(raw):  # every element takes 4 bytes at least
        raise Undecodable("array size")
    if count > MAX_ITEMS:
        raise Undecodable(f"more than {MAX_ITEMS} values in an array, too many to mask")
    return elem, dims, _items(raw, 12 + 8 * ndim, count)


def _encode_array(elem: int, dims: list[tuple[int, int]], items: list[bytes | None]) -> bytes:
    parts = [struct.pack("!iiI", len(dims), 1 if any(item is None for item in items) else 0, elem)]
    parts.extend(struct.pack("!ii", size, lower) for size, lower in dims)
    for item in items:
        parts.append(b"\xff\xff\xff\xff" if item is None else _I32.pack(len(item)) + item)
    return b"".join(parts)


def _record(raw: bytes) -> list[tuple[int, bytes | None]]:
    """(type, value) of each field of a record_send value."""
    if len(raw) < 4:
        raise Undecodable("a value ends early")
    count = _I32.unpack_from(raw)[0]
    if not 0 <= count <= len(raw):
        raise Undecodable("record size")
    fields: list[tuple[int, bytes | None]] = []
    pos, end = 4, len(raw)
    unpack = _FIELD_HEAD.unpack_from
    for _ in range(count):
        if pos + 8 > end:
            raise Undecodable("a value ends early")
        oid, n = unpack(raw, pos)
        pos += 8
        if n < 0:
            if n != -1:
                raise Undecodable("a negative length")
            fields.append((oid, None))
        else:
            if pos + n > end:
                raise Undecodable("a value ends early")
            fields.append((oid, raw[pos:pos + n]))
            pos += n
    if pos != end:
        raise Undecodable("bytes after the value")
    return fields


def _encode_record(fields: list[tuple[int, bytes | None]]) -> bytes:
    parts = [_I32.pack(len(fields))]
    for oid, value in fields:
        parts.append(_U32.pack(oid))
        parts.append(b"\xff\xff\xff\xff" if value is None else _I32.pack(len(value)) + value)
    return b"".join(parts)


_RANGE_EMPTY, _RANGE_LB_INC, _RANGE_UB_INC, _RANGE_LB_INF, _RANGE_UB_INF = 0x01, 0x02, 0x04, 0x08, 0x10


def _range(raw: bytes) -> tuple[int, bytes | None, bytes | None]:
    reader = _Reader(raw)
    flags = reader.byte()
    lower = upper = None
    if not flags & _RANGE_EMPTY:
        if not flags & _RANGE_LB_INF:
            lower = reader.value()
        if not flags & _RANGE_UB_INF:
            upper = reader.value()
    reader.done()
    return flags, lower, upper


def _multirange(raw: bytes) -> list[bytes]:
    reader = _Reader(raw)
    count = reader.i32()
    if not 0 <= count <= len(raw):
        raise Undecodable("multirange size")
    ranges = []
    for _ in range(count):
        value = reader.value()
        if value is None:
            raise Undecodable("a NULL range in a multirange")
        ranges.append(value)
    reader.done()
    return ranges


# -- rendering: the text the server would send, near enough for a pattern to find what a value holds

_ARRAY_QUOTED = re.compile(r'[{}",\\\s]').search  # what makes the server quote an array element
_RECORD_QUOTED = re.compile(r'[(),"\\\s]').search  # a record field
_RANGE_QUOTED = re.compile(r'[\[\](),"\\\s]').search  # a range bound


def _quote_array(text: str) -> str:
    if text == "" or _ARRAY_QUOTED(text) is not None or len(text) == 4 and text.upper() == "NULL":
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return text


def _quote_record(text: str) -> str:
    if text == "" or _RECORD_QUOTED(text) is not None:
        return '"' + text.replace('"', '""').replace("\\", "\\\\") + '"'
    return text


def _quote_range(text: str) -> str:
    if text == "" or _RANGE_QUOTED(text) is not None:
        return '"' + text.replace('"', '""').replace("\\", "\\\\") + '"'
    return text


def render(shapes: TypeShapes, oid: int, raw: bytes, depth: int = 0) -> str:
    """A binary value as text, containers as the server writes them (``{a,b}``, ``(a,b)``, ``[a,b)``).

    Raises Undecodable for a type ``shapes`` does not know or bytes not in its format.
    """
    leaf = _LEAVES.get(oid)
    try:
        if leaf is not None:
            return leaf(raw)
        if depth > MAX_DEPTH:
            raise Undecodable("nested too deep")
        found = shapes.shape(oid)
        if found is None:
            raise Undecodable(f"type {oid} is not known")
        kind, link = found
        if kind == TEXT:  # the database's own: an enum, citext
            return _text(raw)
        if kind == DOMAIN:
            return render(shapes, link, raw, depth + 1)
        if kind == ARRAY:
            elem, dims, items = _array(raw)
            leaf = _LEAVES.get(elem)
            if leaf is not None:  # the usual array: of one built-in value each
                texts = ["NULL" if item is None else _quote_array(leaf(item)) for item in items]
            else:
                texts = ["NULL" if item is None else _quote_array(render(shapes, elem, item, depth + 1))
                         for item in items]
            if len(dims) == 1 and dims[0][1] == 1:
                return "{" + ",".join(texts) + "}"
            return _nest(dims, texts)
        if kind == RECORD:
            return "(" + ",".join("" if value is None else _quote_record(render(shapes, field, value, depth + 1))
                                  for field, value in _record(raw)) + ")"
        if kind == RANGE:
            return _render_range(shapes, link, raw, depth)
        if kind == MULTIRANGE:
            subtype = shapes.shape(link)
            if subtype is None or subtype[0] != RANGE:
                raise Undecodable(f"range type {link} is not known")
            return "{" + ",".join(_render_range(shapes, subtype[1], item, depth + 1) for item in _multirange(raw)) + "}"
    except (ValueError, struct.error, IndexError, OverflowError) as exc:
        if isinstance(exc, Undecodable):
            raise
        raise Undecodable(f"a value of type {oid} is not in its binary format") from None
    raise Undecodable(f"type {oid} is not known")


def _nest(dims: list[tuple[int, int]], texts: list[str]) -> str:
    if not dims:
        return "{}"
    for size, _ in reversed(dims):  # innermost first
        texts = ["{" + ",".join(texts[i:i + size]) + "}" for i in range(0, len(texts), size)] if size else ["{}"]
    text = texts[0] if texts else "{}"
    if any(lower != 1 for _, lower in dims):
        text = "".join(f"[{lower}:{lower + size - 1}]" for size, lower in dims) + "=" + text
    return text


def _render_range(shapes: TypeShapes, subtype: int, raw: bytes, depth: int) -> str:
    flags, lower, upper = _range(raw)
    if flags & _RANGE_EMPTY:
        return "empty"
    low = "" if lower is None else _quote_range(render(shapes, subtype, lower, depth + 1))
    high = "" if upper is None else _quote_range(render(shapes, subtype, upper, depth + 1))
    return ("[" if flags & _RANGE_LB_INC else "(") + low + "," + high + ("]" if flags & _RANGE_UB_INC else ")")


def render_binary(oid: int, raw: bytes, shapes: TypeShapes | None = None) -> str:
    """One binary-format value as text (the recording's, the output rules'); a value that cannot be read
    (an unknown type, malformed bytes) as ``\\x<hex>``."""
    leaf = _LEAVES.get(oid)  # ``render``'s first step, here: it runs for every binary cell of every row
    try:
        return leaf(raw) if leaf is not None else render(shapes or BUILTIN, oid, raw)
    except (Undecodable, ValueError, struct.error, IndexError, OverflowError):
        return "\\x" + raw.hex()


# -- masking

def mask_binary(masker: Masker, shapes: TypeShapes, oid: int, raw: bytes,
                style: str | None = None) -> tuple[bytes | None, int] | None:
    """A binary value of type ``oid`` masked: (its new bytes, or None for NULL, and how many values were
    masked), or None when nothing in it is masked.

    ``style``: the value is masked whole (a column masked by name): every text leaf in that style, every
    other leaf NULL; else by the masker's patterns.  Raises Undecodable when the value cannot be read.
    """
    return _mask(masker, shapes, oid, raw, style, 0)


def _mask(masker: Masker, shapes: TypeShapes, oid: int, raw: bytes, style: str | None,
          depth: int) -> tuple[bytes | None, int] | None:
    if depth > MAX_DEPTH:
        raise Undecodable("nested too deep")
    found = shapes.shape(oid)
    if found is None:
        raise Undecodable(f"type {oid} is not known")
    kind, link = found
    try:
        if kind == TEXT:
            if style is not None:
                return masker.mask_whole(raw, style), 1
            return masker.mask(raw)
        if kind == JSON or kind == JSONB:
            return _mask_json(masker, raw, kind == JSONB, style)
        if kind == SCALAR:
            if style is not None:
                return None, 1
            renderer = _RENDERERS[oid]
            masked = masker.mask(renderer(raw).encode("utf-8", "surrogateescape"))
            return None if masked is None else (None, masked[1])
        if kind == DOMAIN:
            return _mask(masker, shapes, link, raw, style, depth + 1)
        if kind == ARRAY:
            elem, dims, items = _array(raw)
            changed, count = _mask_items(masker, shapes, [(elem, item) for item in items], style, depth)
            return None if not count else (_encode_array(elem, dims, [value for _, value in changed]), count)
        if kind == RECORD:
            fields = _record(raw)
            changed, count = _mask_items(masker, shapes, fields, style, depth)
            return None if not count else (_encode_record(changed), count)
        if kind == RANGE or kind == MULTIRANGE:
            if kind == RANGE:
                ranges, subtype = [raw], link
            else:
                range_shape = shapes.shape(link)
                if range_shape is None or range_shape[0] != RANGE:
                    raise Undecodable(f"range type {link} is not known")
                ranges, subtype = _multirange(raw), range_shape[1]
            bounds = []
            for item in ranges:
                _, lower, upper = _range(item)
                bounds.extend((subtype, bound) for bound in (lower, upper) if bound is not None)
            if style is not None:
                for _, bound in bounds:  # read, though masked whole: a value that cannot be read is withheld
                    render(shapes, subtype, bound, depth + 1)
                return None, 1
            _, count = _mask_items(masker, shapes, bounds, None, depth)
            return (None, count) if count else None  # a bound cannot be NULL: the whole range is
    except (ValueError, struct.error, IndexError, OverflowError, KeyError) as exc:
        if isinstance(exc, Undecodable):
            raise
        raise Undecodable(f"a value of type {oid} is not in its binary format") from None
    raise Undecodable(f"type {oid} is not known")


def _mask_items(masker: Masker, shapes: TypeShapes, items: list[tuple[int, bytes | None]], style: str | None,
                depth: int) -> tuple[list[tuple[int, bytes | None]], int]:
    """Each (type, value) masked; the new list and how many values were masked (0: nothing changed).

    Under patterns, when every item is a built-in single value, their texts are searched once together first
    (joined by tabs, as a row's cells are: ``Masker.row_spans``): most containers hold nothing to mask, and
    only the items a match falls in are masked.
    """
    todo: set[int] | None = None  # the items to mask (None: every one)
    if style is None and masker.row_prefilter:
        texts: list[bytes] = []
        where: list[int] = []
        for i, (oid, value) in enumerate(items):
            if value is None:
                continue
            leaf = _LEAVES.get(oid)
            if leaf is None:  # a container, or a type of the database's own: every item is walked
                break
            texts.append(value if oid in _RAW_TEXT else leaf(value).encode("utf-8", "surrogateescape"))
            where.append(i)
        else:
            spans = masker.row_spans(b"\t".join(texts), MAX_MATCHES)
            if spans is None:
                raise Undecodable(f"the patterns find more than {MAX_MATCHES} values in it, too many to mask")
            if not spans:
                return items, 0
            ends = []
            end = -1
            for text in texts:
                end += len(text) + 1
                ends.append(end)
            todo = {where[j] for j in masker.cells_spanned(ends, spans)}
    out: list[tuple[int, bytes | None]] = []
    total = 0
    for i, (oid, value) in enumerate(items):
        if value is None or todo is not None and i not in todo:
            out.append((oid, value))
            continue
        masked = _mask(masker, shapes, oid, value, style, depth + 1)
        if masked is None:
            out.append((oid, value))
        else:
            out.append((oid, masked[0]))
            total += masked[1]
    return out, total


def _mask_json(masker: Masker, raw: bytes, jsonb: bool, style: str | None) -> tuple[bytes | None, int] | None:
    if jsonb and raw[:1] != b"\x01":
        raise Undecodable("jsonb version")
    payload = raw[1:] if jsonb else raw
    if style is not None:  # a JSON string of the masked value: still JSON
        data = json.dumps(masker.mask_whole(payload, style).decode("utf-8", "replace")).encode()
        return (b"\x01" + data if jsonb else data), 1
    masked = masker.mask(payload)
    if masked is None:
        return None
    data, count = masked
    try:
        json.loads(data)
    except ValueError:
        return None, count
    return (b"\x01" + data if jsonb else data), count
