"""How the PostgreSQL relay writes what it records: a row's values as text, a Bind's parameters beside its SQL.

Rows are tab-separated with ``NULL`` for nulls; binary values are decoded by
their type (``values.render_binary``: the built-in types and the session's
own).  A statement bound with parameters is its SQL, then a ``-- parameters:``
line.  What an auditor sees is frozen by tests/test_recording_equivalence.py.
"""

from __future__ import annotations

from collections.abc import Sequence

from proxies.postgres.messages import Bind, DataRow, render_text_row, resolve_formats
from proxies.postgres.wire import FORMAT_BINARY
from proxies.postgres.values import TypeShapes, render_binary


MAX_PARAM_CHARS = 1024  # longer bind parameters are shortened in the recording


def render_typed_row(row: DataRow, formats: Sequence[int], oids: Sequence[int],
                     shapes: TypeShapes | None = None) -> str:
    """A row with binary columns as text (tab-separated, NULL for nulls), decoding by column type."""
    return render_values(row.columns, formats, oids, shapes)


def render_row(row: DataRow, formats: Sequence[int], oids: Sequence[int], shapes: TypeShapes | None = None) -> str:
    """A row as the recording and the output rules read it: tab-separated, NULL for nulls, binary columns
    decoded by type (``values.render_binary``: ``shapes``, the types the session knows; the built-in ones)."""
    if FORMAT_BINARY in formats:
        return render_typed_row(row, formats, oids, shapes)
    return render_text_row(row, formats, "NULL", "\t", -1)


def render_values(values: Sequence[bytes | None], formats: Sequence[int], oids: Sequence[int],
                  shapes: TypeShapes | None = None) -> str:
    """``render_typed_row`` of a row's values."""
    parts = []
    noids = len(oids)
    nformats = len(formats)
    for i, value in enumerate(values):
        if value is None:
            parts.append("NULL")
        elif i < nformats and formats[i] == FORMAT_BINARY:
            parts.append(render_binary(oids[i] if i < noids else 0, value, shapes))
        else:
            parts.append(value.decode("utf-8", "replace"))
    return "\t".join(parts)


def _quote(value: bytes | None, binary: bool) -> str:
    if value is None:
        return "NULL"
    if binary:
        return "'\\x" + value[:MAX_PARAM_CHARS].hex() + "'"
    text = value[:MAX_PARAM_CHARS * 4].decode("utf-8", "replace")
    if len(text) > MAX_PARAM_CHARS:
        text = text[:MAX_PARAM_CHARS] + "..."
    return "'" + text.replace("'", "''") + "'"


def render_bind(sql: str, bind: Bind) -> str:
    """A Bind as recorded: the statement's SQL, then its parameters as text on a comment line."""
    return render_params(sql, bind.params, bind.param_formats)


def render_params(sql: str, params: list[bytes | None], param_formats: list[int]) -> str:
    """``render_bind`` of a Bind's decoded parameters and their format codes."""
    if not params:
        return sql
    if len(params) == 1:  # the usual prepared statement of a benchmark or a lookup: one parameter
        return f"{sql}\n-- parameters: $1 = {_quote(params[0], bool(param_formats) and param_formats[0] == FORMAT_BINARY)}"
    formats = resolve_formats(param_formats, len(params))
    rendered = []
    for i in range(len(params)):
        rendered.append(f"${i + 1} = {_quote(params[i], formats[i] == FORMAT_BINARY)}")
    return f"{sql}\n-- parameters: {', '.join(rendered)}"
