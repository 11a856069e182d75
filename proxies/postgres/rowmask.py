"""Masking a PostgreSQL row, notice or description in place: which cells, what each becomes, the frame spliced.

What the session's ``Masker`` (gatewayd.masking) finds in a row's text, or the
columns a rule names, is rewritten cell by cell in the row's own frame, text
and binary formats alike: a text cell gets the masked text, a value of a type
that cannot hold it becomes NULL (``_NOT_TEXT_OIDS``), a binary container is
masked value by value (``values.mask_binary``); what cannot be masked quickly
enough or read at all is withheld.  Errors, notices, notifications,
ParameterStatus and column names are masked by pattern.  The relay
(``ServerSide``) decides when; these functions are pure.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from proxies.postgres.codec import FORMAT_BINARY, DataRow, Message, ProtocolError, RowDescription, decode_backend
from proxies.postgres.values import (BUILTIN, JSON, JSONB, SCALAR, TEXT, TypeShapes, Undecodable, mask_binary,
                                     render_binary)

from gatewayd.masking import FIXED

from proxies.postgres.rendering import render_values

if TYPE_CHECKING:
    from gatewayd.masking import Masker
    from gatewayd.policy import SessionPolicy

MASK_ROW_BYTES = 1 << 20  # under a mask rule, a row's longest values are withheld past this ([postgres] mask_row_bytes)
MAX_ROW_MATCHES = 1000  # under a mask rule, a row (a COPY line, a notice) where the patterns find more is withheld
WITHHELD_SQLSTATE = "01000"  # warning: the NoticeResponse saying a value was withheld


# -- masking: what a masked cell becomes, by its column's type

# text-format columns whose masked text the type still reads: anything not listed here (text, varchar,
# names, enums, composite and user types, text arrays...); these take NULL instead
_NOT_TEXT_OIDS = frozenset((
    16, 17, 18, 20, 21, 22, 23, 26, 27, 28, 29, 30, 650, 700, 701, 774, 790, 829, 869, 1082, 1083, 1114, 1184,
    1186, 1266, 1560, 1562, 1700, 2950, 3220, 3614, 3615, 3904, 3906, 3908, 3910, 3912, 3926, 4451, 4532,
    # arrays of the above
    1000, 1001, 1002, 1005, 1006, 1007, 1016, 1021, 1022, 1028, 1115, 1182, 1183, 1185, 1187, 1231, 1270, 2951,
    651, 1040, 1041, 775, 791,
))
_JSON_OIDS = frozenset((114, 3802))


_I32 = struct.Struct("!i").unpack_from
_U16 = struct.Struct("!H").unpack_from


def layout(row: DataRow) -> tuple[list[int], list[int], list[int]]:
    """Where each value's length field is in the row's frame, that length (-1: NULL), and where the value
    ends in the row's text if that is its values joined by tabs (``NULL`` for a null); nothing copied.

    The row was rendered first (``render_text_row``/``render_typed_row``), which checked its lengths.
    """
    buf, pos = row._buf, row._start + 7
    at: list[int] = []
    sizes: list[int] = []
    ends: list[int] = []
    end = -1
    for _ in range(row.column_count):
        at.append(pos)
        n = _I32(buf, pos)[0]
        sizes.append(n)
        if n < 0:
            pos += 4
            end += 5
        else:
            pos += 4 + n
            end += n + 1
        ends.append(end)
    return at, sizes, ends


def _value(row: DataRow, at: list[int], sizes: list[int], i: int) -> bytes | None:
    n = sizes[i]
    return None if n < 0 else row._buf[at[i] + 4:at[i] + 4 + n]


_LENGTH = struct.Struct("!i").pack
_HEADER = struct.Struct("!ci").pack


def splice_row(row: DataRow, masked: dict[int, bytes | None], at: Sequence[int] | dict[int, int]) -> bytes:
    """The row's frame with the ``masked`` values (by index, in increasing order) replaced, every other byte copied."""
    buf = row._buf
    parts: list[bytes] = [b""]  # the header, once the length is known
    pos = row._start + 5
    size = row._end - pos + 4
    for i, value in masked.items():
        parts.append(buf[pos:at[i]])
        n = max(_I32(buf, at[i])[0], 0)
        if value is None:
            parts.append(b"\xff\xff\xff\xff")
            size -= n
        else:
            parts.append(_LENGTH(len(value)))
            parts.append(value)
            size += len(value) - n
        pos = at[i] + 4 + n
    parts.append(buf[pos:row._end])
    parts[0] = _HEADER(b"D", size)
    return b"".join(parts)


def render_masked(text: str, row: DataRow, masked: dict[int, bytes | None], formats: Sequence[int],
                  oids: Sequence[int], shapes: TypeShapes | None = None) -> str:
    """The masked row's text (``render_values`` of its values), from ``text``, the row's own rendering.

    Only the masked cells are rendered again: the others are ``text``'s, split at its tabs when no cell
    holds a tab (as many pieces as cells); otherwise the whole row is rendered again.
    """
    parts = text.split("\t")
    if len(parts) != row.column_count:
        at, sizes, _ = layout(row)
        values = [_value(row, at, sizes, i) for i in range(len(at))]
        for i, value in masked.items():
            values[i] = value
        return render_values(values, formats, oids, shapes)
    nformats = len(formats)
    for i, value in masked.items():
        if value is None:
            parts[i] = "NULL"
        elif i < nformats and formats[i] == FORMAT_BINARY:
            parts[i] = render_binary(oids[i] if i < len(oids) else 0, value, shapes)
        else:
            parts[i] = value.decode("utf-8", "replace")
    return "\t".join(parts)


def _one_string(shapes: TypeShapes, oid: int) -> bool:
    """Whether a text-format value of ``oid`` is one string (``text``, ``varchar``, an enum's label...), not the
    text of a record, an array, a range or a document."""
    found = shapes.shape(oid)
    return found is not None and found[0] == TEXT


def payload_of(value: bytes, jsonb: bool) -> bytes:
    return value[1:] if jsonb else value


def _valid_json(data: bytes) -> bool:
    try:
        json.loads(data)
    except ValueError:
        return False
    return True


def _text_cells(row: DataRow, text: bytes, spans: list[tuple[int, int]],
                named: Iterable[int] = ()) -> list[tuple[int, int, int]] | None:
    """(index, where its length field is, its length) of the cells that ``spans`` overlap and the ``named``
    ones (in any order), increasing, each once, from the row's text.

    Only when ``text`` is the row's values joined by tabs byte for byte (as many tabs as cells, and the
    frame's size says so: no NULL, no invalid UTF-8 replaced by longer text): a cell's place in the text
    then gives its place in the frame, with no walk over the other cells; otherwise None.
    """
    count = row.column_count
    size = len(text)
    if not count or text.count(b"\t") != count - 1 or row._end - row._start - 7 - 4 * count != size - count + 1:
        return None
    base = row._start + 7
    buf = row._buf
    found: list[tuple[int, int, int]] = []
    last = -1
    following = 0  # where the cell after the last one found starts
    tabs = counted = 0  # text[:counted] holds ``tabs`` tabs: the spans increase, so each byte is counted once
    for start, end in spans:
        if end == start:  # a pattern that matches nothing at all: every cell
            return None
        tabs += text.count(b"\t", counted, start + 1)
        counted = start + 1
        i = tabs
        if i <= last:
            i, cell = last + 1, following
        else:
            cell = text.rfind(b"\t", following, start + 1) + 1 or following  # not before the last cell found
        while i < count and cell < end:
            stop = text.find(b"\t", cell)
            if stop < 0:
                stop = size
            found.append((i, base + 3 * i + cell, stop - cell))
            last = i
            i += 1
            cell = stop + 1
        following = cell
    if named:
        have = {i for i, _, _ in found}
        j = cell = 0  # the start of cell j: the named cells found walking the tabs once, left to right
        for index in sorted(named):
            if index >= count:
                break
            while j < index:
                cell = text.find(b"\t", cell) + 1
                j += 1
            if index in have:
                continue
            stop = text.find(b"\t", cell)
            if stop < 0:
                stop = size
            found.append((index, base + 3 * index + cell, stop - cell))
            have.add(index)
        found.sort()
    for i, at, n in found:
        if _I32(buf, at)[0] != n:  # cannot be, by the sizes checked above: the walk, then
            return None
    return found


def unlike_their_values(text: str, deep: tuple[int, ...], count: int) -> tuple[int, ...]:
    """Of the ``deep`` cells of a row whose text the patterns found nothing in, those that must be walked all
    the same: the ones whose text may not hold their values as they are -- escaped (``\\"``, ``""``, ``\\\\``
    inside quotes) or not read at all (``\\x<hex>``: withheld).  In the others every value stands as it is,
    between separators that are no word characters, as a row's cells stand between tabs: nothing to mask."""
    pieces = text.split("\t")
    if len(pieces) != count:  # a cell holds a tab: the pieces are not the cells
        return deep
    return tuple(i for i in deep if "\\" in pieces[i] or '""' in pieces[i])


FALLBACK = object()  # ``mask_text_row``: this row takes the general path
_FIXED_CELL = _LENGTH(len(FIXED)) + FIXED  # a cell masked whole in the ``fixed`` style, its length field first
_FIXED_TEXT = FIXED.decode()


def mask_text_row(masker: Masker, row: DataRow, text: str, data: bytes, spans: list[tuple[int, int]],
                  oids: Sequence[int]) -> tuple[bytes, str, int] | None | object:
    """``mask_row`` then ``render_masked`` in one pass, for the usual row: (masked frame, recorded text, count).

    None when nothing was masked; ``FALLBACK`` when the row is not the usual one, for the general path:
    the usual one has its formats all text, no column masked by name, ``data`` (``text`` encoded) its
    cells joined by tabs byte for byte (``_text_cells``' test), and only plain text or non-text cells
    where the ``spans`` of the row's search fall (a JSON cell goes the general way).  A masked cell's
    new text goes into ``text`` at the same place when ``text`` is ASCII (one character a byte).
    """
    buf = row._buf
    start = row._start
    count = _U16(buf, start + 5)[0]
    size = len(data)
    if not count or row._end - start - 7 - 4 * count != size - count + 1 or data.count(b"\t") != count - 1:
        return FALLBACK
    base = start + 7
    noids = len(oids)
    if len(spans) == 1:  # the usual case: one match, in one cell, straight through
        begin, end = spans[0]
        cell = data.rfind(b"\t", 0, begin + 1) + 1
        stop = data.find(b"\t", begin)
        if stop < 0:
            stop = size
        if cell <= begin < end <= stop:
            i = count - 1 if stop == size else data.count(b"\t", 0, cell)  # the last cell: every tab before it
            oid = oids[i] if i < noids else 0
            if oid in _JSON_OIDS:
                return FALLBACK
            at = base + 3 * i + cell  # the cell's length field in the frame: its bytes follow
            n = stop - cell
            masked = masker.mask_found(buf[at + 4:at + 4 + n], [(begin - cell, end - cell)])
            if masked is None:
                return None
            frame_end = row._end
            if oid in _NOT_TEXT_OIDS:
                value = None
                frame = b"".join((_HEADER(b"D", frame_end - start - 1 - n), buf[start + 5:at], b"\xff\xff\xff\xff",
                                  buf[at + 4 + n:frame_end]))
                shown = "NULL"
                total = 1
            else:
                value, total = masked
                if value is FIXED:  # the usual mask: its bytes in the frame and its text made once
                    middle, shown = _FIXED_CELL, _FIXED_TEXT
                else:
                    middle, shown = _LENGTH(len(value)) + value, value.decode("utf-8", "replace")
                frame = b"".join((_HEADER(b"D", frame_end - start - 5 + len(middle) - n), buf[start + 5:at], middle,
                                  buf[at + 4 + n:frame_end]))
            if len(text) == size:  # ASCII: one character a byte
                return frame, text[:cell] + shown + text[stop:], total
            return frame, render_masked(text, row, {i: value}, (), oids), total
    # the cells the spans overlap, in increasing order: [index, start, end in data, the spans wholly inside
    # it, relative to it (None when a span crosses it: its finders search it)]
    cells: list[list] = []
    # the spans increase: each byte is counted once (data[:counted] holds ``tabs`` tabs), and each cell's ends are
    # looked for once (the last cell's: ``last``, ``last_cell``, ``last_stop``), however many spans one cell holds
    tabs = counted = 0
    last, last_cell, last_stop = -1, 0, 0
    for begin, end in spans:
        if end == begin:  # a pattern that matches nothing at all: every cell
            return FALLBACK
        tabs += data.count(b"\t", counted, begin + 1)
        counted = begin + 1
        i = tabs
        cell = last_cell if i == last else data.rfind(b"\t", last_cell, begin + 1) + 1 or last_cell
        while i < count and cell < end:
            if i == last:
                stop = last_stop
            else:
                stop = data.find(b"\t", cell)
                if stop < 0:
                    stop = size
                last, last_cell, last_stop = i, cell, stop
            inside = begin >= cell and end <= stop
            if cells and cells[-1][0] == i:  # a span after another in the same cell
                entry = cells[-1]
                if entry[3] is not None:
                    if inside:
                        entry[3].append((begin - cell, end - cell))
                    else:
                        entry[3] = None
            else:
                cells.append([i, cell, stop, [(begin - cell, end - cell)] if inside else None])
            i += 1
            cell = stop + 1
    found: list[tuple[int, int, int, bytes | None]] = []  # (index, cell start, cell end, masked value) in data
    total = 0
    for i, cell, stop, inside in cells:
        oid = oids[i] if i < noids else 0
        if oid in _JSON_OIDS:
            return FALLBACK
        at = base + 3 * i + cell  # the cell's length field in the frame: its bytes follow
        value = buf[at + 4:at + 4 + stop - cell]
        masked = masker.mask(value, searched=True) if inside is None else masker.mask_found(value, inside)
        if masked is not None:
            if oid in _NOT_TEXT_OIDS:
                found.append((i, cell, stop, None))
                total += 1
            else:
                found.append((i, cell, stop, masked[0]))
                total += masked[1]
    if not total:
        return None
    ascii_text = len(text) == size
    if len(found) == 1:  # the usual case: one cell
        i, cell, stop, value = found[0]
        at = base + 3 * i + cell
        n = stop - cell
        if value is None:
            middle = b"\xff\xff\xff\xff"
            length = row._end - start - 1 - n
            shown = "NULL"
        else:
            middle = _LENGTH(len(value)) + value
            length = row._end - start - 1 + len(value) - n
            shown = value.decode("utf-8", "replace")
        frame = b"".join((_HEADER(b"D", length), buf[start + 5:at], middle, buf[at + 4 + n:row._end]))
        if ascii_text:
            return frame, text[:cell] + shown + text[stop:], total
        return frame, render_masked(text, row, {i: value}, (), oids), total
    parts: list[bytes] = [b""]  # the header, once the length is known
    pos = start + 5
    length = row._end - pos + 4
    pieces: list[str] = []
    done = 0  # where ``text`` was copied up to
    for i, cell, stop, value in found:
        at = base + 3 * i + cell
        parts.append(buf[pos:at])
        n = stop - cell
        if value is None:
            parts.append(b"\xff\xff\xff\xff")
            length -= n
            shown = "NULL"
        else:
            parts.append(_LENGTH(len(value)))
            parts.append(value)
            length += len(value) - n
            shown = value.decode("utf-8", "replace")
        pos = at + 4 + n
        if ascii_text:
            pieces.append(text[done:cell])
            pieces.append(shown)
            done = stop
    parts.append(buf[pos:row._end])
    parts[0] = _HEADER(b"D", length)
    if ascii_text:
        pieces.append(text[done:])
        recorded = "".join(pieces)
    else:
        recorded = render_masked(text, row, {i: value for i, _, _, value in found}, (), oids)
    return b"".join(parts), recorded, total


def mask_named_row(masker: Masker, row: DataRow, text: str, whole: tuple[tuple[int, str], ...],
                   oids: Sequence[int]) -> tuple[bytes, str, int] | None | object:
    """``mask_row`` then ``render_masked`` in one pass for a text row masked by column name alone:
    (masked frame, recorded text, count), None when no such column is in the row.

    ``whole``: the columns masked whole (increasing, not empty), for a row the patterns found nothing
    in.  ``FALLBACK`` unless the row is the usual one: formats all text (the caller's test), ``text``
    ASCII with as many tabs as cells, and the frame's size saying so (then no NULL: a character of
    ``text`` is a byte of the frame, and where a cell is in ``text`` says where it is in the frame,
    with no walk over the other cells), and no JSON column masked.
    """
    buf = row._buf
    start = row._start
    count = _U16(buf, start + 5)[0]
    size = len(text)
    if not text.isascii() or row._end - start - 7 - 4 * count != size - count + 1 or text.count("\t") != count - 1:
        return FALLBACK
    base = start + 7
    parts: list[bytes] = [b""]  # the header, once the length is known
    pieces: list[str] = []
    length = row._end - start - 1
    pos = start + 5  # copied up to there in the frame
    done = 0  # and in ``text``
    total = 0
    j = cell = 0  # cell j starts at ``cell`` in ``text``
    for i, style in whole:
        if i >= count:
            break
        if not total and 2 * i >= count:  # the first one, nearer the row's end: the tabs counted from there
            tab = size
            for _ in range(count - i):
                tab = text.rfind("\t", 0, tab)
            cell = tab + 1
        else:
            while j < i:
                cell = text.find("\t", cell) + 1
                j += 1
        stop = text.find("\t", cell)
        if stop < 0:
            stop = size
        oid = oids[i] if i < len(oids) else 0
        at = base + 3 * i + cell  # the cell's length field in the frame: its bytes follow
        n = stop - cell
        parts.append(buf[pos:at])
        if oid in _NOT_TEXT_OIDS:
            parts.append(b"\xff\xff\xff\xff")
            length -= n
            shown = "NULL"
        elif oid in _JSON_OIDS:
            return FALLBACK
        elif style == "fixed":
            parts.append(_FIXED_CELL)
            length += len(FIXED) - n
            shown = _FIXED_TEXT
        else:
            value = masker.mask_whole(buf[at + 4:at + 4 + n], style)
            parts.append(_LENGTH(len(value)))
            parts.append(value)
            length += len(value) - n
            shown = value.decode("utf-8", "replace")
        pieces.append(text[done:cell])
        pieces.append(shown)
        pos = at + 4 + n
        done = stop
        total += 1
        cell = stop + 1
        j = i + 1
    if not total:
        return None
    parts.append(buf[pos:row._end])
    parts[0] = _HEADER(b"D", length)
    pieces.append(text[done:])
    return b"".join(parts), "".join(pieces), total


def mask_row(masker: Masker, row: DataRow, formats: Sequence[int], oids: Sequence[int],
             whole: tuple[tuple[int, str], ...] | None, spans: list[tuple[int, int]] | None = None,
             total: int = -1, text: bytes | None = None, shapes: TypeShapes = BUILTIN, deep: Sequence[int] = (),
             withheld: list[tuple[int, str]] | None = None,
             rendered: str | None = None) -> tuple[bytes, dict[int, bytes | None], int] | None:
    """(the masked row's frame, its masked values by index, how many values were masked); None when nothing was.

    ``whole``: columns masked whole by name, with their style; None when the column names are not
    known and the masker has rules by name: every value is masked whole (fail closed).  ``spans``:
    where the fast path matched the row's text as rendered (``total`` bytes long), if it was searched;
    ``text``: that text, if the formats are all text.  Only the cells a pattern may match or a name
    masks are read out of the frame, and the ``deep`` ones: binary cells that are no single value (an
    array, a record, a range...: ``values.mask_binary`` walks them) or of a type ``shapes`` does not know
    (withheld: NULL, their index and why added to ``withheld``).  ``rendered``: the row's text (binary cells
    rendered), the cells' text when it has as many tabs as cells.
    """
    nformats = len(formats)
    noids = len(oids)
    if text is not None and whole is not None and spans is not None and (whole or spans and masker.finders):
        by_name = dict(whole)
        cells = _text_cells(row, text, spans if masker.finders else [], by_name)
        if cells is not None:
            return _mask_cells(masker, row, formats, oids, by_name, cells, None, shapes, withheld)
    at, sizes, ends = layout(row)
    ncells = len(at)
    if whole is None:
        style = next(iter(masker.columns.values()), "fixed")
        by_column: dict[int, str] = {i: style for i in range(ncells)}
        if style == "last4":  # a text value that is no single string: its last four characters end its last field
            for i in range(ncells):
                text_format = i >= nformats or formats[i] != FORMAT_BINARY
                if text_format and not _one_string(shapes, oids[i] if i < noids else 0):
                    by_column[i] = "fixed"
    else:
        by_column = dict(whole)
    texts: list[bytes] | None = None
    if not masker.finders:
        todo: Sequence[int] = ()
    elif FORMAT_BINARY in formats and spans is not None and not spans:  # the row's text matched nowhere
        todo = [i for i in deep if i < ncells]  # only the containers are walked: their values may still match
    elif FORMAT_BINARY in formats:  # the cells as text, as the row's text renders them
        pieces = rendered.split("\t") if rendered is not None else ()
        if len(pieces) == ncells:  # that text, cut at its tabs (no cell holds one): nothing rendered again
            texts = [piece.encode("utf-8", "surrogateescape") for piece in pieces]
        else:
            texts = [b"NULL" if value is None else
                     render_binary(oids[i] if i < noids else 0, value, shapes).encode("utf-8", "surrogateescape")
                     if i < nformats and formats[i] == FORMAT_BINARY else value
                     for i, value in ((i, _value(row, at, sizes, i)) for i in range(ncells))]
        todo = masker.candidate_cells(texts, spans, total)
        if deep:
            todo = sorted({*todo, *(i for i in deep if i < ncells)})
    elif spans is not None and ends and ends[-1] == total:  # text cells: the row's text is their bytes
        todo = masker.cells_spanned(ends, spans)
    else:  # not searched, or the row's text is not its bytes (invalid UTF-8 replaced): search the cells
        todo = masker.candidate_cells([b"NULL" if n < 0 else row._buf[at[i] + 4:at[i] + 4 + n]
                                       for i, n in enumerate(sizes)])
    if by_column:  # increasing, each once
        todo = sorted({*todo, *(i for i in by_column if i < ncells)})
    return _mask_cells(masker, row, formats, oids, by_column, [(i, at[i], sizes[i]) for i in todo], texts, shapes,
                       withheld)


def _mask_cells(masker: Masker, row: DataRow, formats: Sequence[int], oids: Sequence[int],
                by_column: dict[int, str], cells: list[tuple[int, int, int]],
                texts: list[bytes] | None, shapes: TypeShapes = BUILTIN,
                withheld: list[tuple[int, str]] | None = None) -> tuple[bytes, dict[int, bytes | None], int] | None:
    """``mask_row`` of these ``cells``: (index, where its length field is, its length), in increasing order."""
    masked: dict[int, bytes | None] = {}
    where: dict[int, int] = {}
    count = 0
    buf = row._buf
    nformats = len(formats)
    noids = len(oids)
    for i, at, n in cells:
        if n < 0:
            continue
        where[i] = at
        value = buf[at + 4:at + 4 + n]
        style = by_column.get(i)
        oid = oids[i] if i < noids else 0
        if i < nformats and formats[i] == FORMAT_BINARY:
            found = shapes.shape(oid)
            kind = found[0] if found is not None else 0
            if kind > SCALAR or kind == 0:  # a container, or a type not known: read it, or withhold it
                try:
                    done = mask_binary(masker, shapes, oid, value, style)
                except Undecodable as exc:
                    done = None, 1
                    if withheld is not None:
                        withheld.append((i, str(exc)))
                if done is not None:
                    masked[i] = done[0]
                    count += done[1]
                continue
            textual = kind != SCALAR
            jsonb = kind == JSONB
            json_cell = jsonb or kind == JSON
        else:
            textual = oid not in _NOT_TEXT_OIDS
            jsonb = False
            json_cell = oid in _JSON_OIDS
        if style is not None:
            if json_cell and textual:  # a JSON string of the masked value: still JSON
                data = json.dumps(masker.mask_whole(payload_of(value, jsonb), style).decode()).encode()
                masked[i] = b"\x01" + data if jsonb else data
            elif textual:
                masked[i] = masker.mask_whole(value, style)
            else:
                masked[i] = None
            count += 1
            continue
        if textual:
            payload = value[1:] if jsonb else value
            found_masked = masker.mask(payload, searched=True)
            if found_masked is None:
                continue
            data, n = found_masked
            count += n
            if json_cell and not _valid_json(data):
                masked[i] = None
            else:
                masked[i] = b"\x01" + data if jsonb else data
        elif masker.mask(texts[i] if texts is not None else value, searched=True) is not None:
            masked[i] = None
            count += 1
    return (splice_row(row, masked, where), masked, count) if count else None


# error and notice fields that quote no data: severity (twice), SQLSTATE, the positions, the server's source file,
# line and routine; every other one may (message, detail, hint, where, query, schema, table, column, datatype,
# constraint, and any field a later server adds)
_KEPT_FIELDS = frozenset(b"SVCPpFLR")


def _mask_string(masker: Masker, string: bytes, limit: int) -> tuple[bytes, int] | None:
    """A protocol string masked by pattern (NULs taken out: they end it), and how many values; None when nothing
    was.  One longer than ``limit`` bytes, or where the patterns find more than MAX_ROW_MATCHES values, is
    withheld whole: masking it would hold the loop too long."""
    if len(string) > limit or masker.row_spans(string, MAX_ROW_MATCHES) is None:
        return f"[{len(string)} bytes withheld by gatewayd: too long to mask]".encode(), 1
    masked = masker.mask(string)
    return None if masked is None else (masked[0].replace(b"\0", b""), masked[1])


def _mask_strings(masker: Masker, strings: list[bytes], limit: int) -> tuple[list[bytes], int]:
    """Each string ``_mask_string``-ed; how many values."""
    count = 0
    out = []
    for string in strings:
        masked = _mask_string(masker, string, limit) if string else None
        if masked is None:
            out.append(string)
        else:
            out.append(masked[0])
            count += masked[1]
    return out, count


def mask_notice(masker: Masker, message: Message, limit: int = MASK_ROW_BYTES) -> tuple[bytes, int] | None:
    """An ErrorResponse/NoticeResponse with its fields that may quote data masked (all but ``_KEPT_FIELDS``),
    a NotificationResponse with its channel and payload masked, or a ParameterStatus with its name and
    value masked, and how many values; None when nothing was.

    A value quoted in an error (``invalid input syntax for type integer: "jane@example.com"``, a
    unique violation's ``Key (email)=(...)``, a constraint or column named after data), sent by
    ``RAISE NOTICE``/``pg_notify`` (its channel too), or set with ``set_config`` is data too.  A string too long
    to mask (``_mask_string``) is withheld.
    """
    message.validate()  # a malformed one is the target's protocol error, as anywhere else
    if not masker.finders:  # rules by column name only: nothing here is a column
        return None
    body = bytes(message.body)
    if len(body) <= limit and masker.row_prefilter and not masker.may_match(body):  # NULs end its strings, as
        return None  # tabs end a row's cells
    code = message.TYPE
    if code == b"A":
        nul = body.index(b"\0", 4)
        (channel, payload), count = _mask_strings(masker, [body[4:nul], body[nul + 1:-1]], limit)
        body = body[:4] + channel + b"\0" + payload + b"\0"
    elif code == b"S":
        nul = body.index(b"\0")
        (name, value), count = _mask_strings(masker, [body[:nul], body[nul + 1:-1]], limit)
        body = name + b"\0" + value + b"\0"
    else:
        fields = body.split(b"\0")
        count = 0
        for i, field in enumerate(fields):
            if field and field[0] not in _KEPT_FIELDS:
                masked = _mask_string(masker, field[1:], limit)
                if masked is not None:
                    fields[i] = field[:1] + masked[0]
                    count += masked[1]
        body = b"\0".join(fields)
    if not count:
        return None
    return code + struct.pack("!i", len(body) + 4) + body, count


def mask_frames(policy: SessionPolicy, frames: Iterable[bytes]) -> list[bytes]:
    """The target's start-up answer (ParameterStatus, notices) as the client may see it: a setting made from
    data in an earlier session (``ALTER ROLE ... SET application_name = ...``) is masked like any other."""
    masker = policy.masker
    if masker is None:
        return list(frames)
    out = []
    for frame in frames:
        message = decode_backend(frame)
        masked = mask_notice(masker, message) if message.TYPE in b"SNEA" else None
        if masked is None:
            out.append(frame)
        else:
            out.append(masked[0])
            policy.count_masked(masked[1])
    return out


def mask_names(masker: Masker, message: RowDescription) -> tuple[bytes, list[str], int] | None:
    """A RowDescription whose column names a pattern matches (a view's column named after data, ``format('%I',
    ...)``), with those names masked: (its frame, the names, how many); None when no name is masked.

    The rest of each field (its table, column number, type, format) is kept: the rules by column name read the
    target's own names, the client and the recording the masked ones.
    """
    buf, pos, end = message._buf, message._start + 7, message._end
    names: list[bytes] = []
    fixed: list[bytes] = []
    for _ in range(message.column_count):
        nul = buf.find(b"\0", pos, end)
        if nul < 0 or nul + 19 > end:
            raise ProtocolError("malformed RowDescription message: unexpected end of message")
        names.append(buf[pos:nul])
        fixed.append(buf[nul + 1:nul + 19])
        pos = nul + 19
    if masker.row_prefilter and not masker.row_spans(b"\t".join(names)):
        return None
    masked, count = _mask_strings(masker, names, MASK_ROW_BYTES)
    if not count:
        return None
    body = buf[message._start + 5:message._start + 7] + b"".join(name + b"\0" + rest for name, rest in zip(masked, fixed))
    return (b"T" + struct.pack("!i", len(body) + 4) + body, [name.decode("utf-8", "replace") for name in masked],
            count)
