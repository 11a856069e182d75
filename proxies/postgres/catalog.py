"""What the target's catalog says of the columns a mask rule names: where they are, whatever a query calls them.

A RowDescription names each result column as the query spelled it (``select email as e``), but
for a column taken from a table it also carries the table's OID and the column's number, which
PostgreSQL follows through aliases, subqueries and CTEs. One query on a connection of its own,
when a session whose rules mask columns by name starts, maps those (table OID, column number)
pairs to the names the rules know; the relay then masks a column by its source as well as by its
name. What a query computes (``lower(email)``, a view's column) has no source column: pattern
rules cover it (docs/decisions.md, "Masking").
"""

from __future__ import annotations

from typing import Iterable

from gatewayd.dialer import Dialer
from proxies.postgres.codec import DataRow, ErrorResponse, ReadyForQuery, encode_query
from proxies.postgres.upstream import TargetSettings, UpstreamError, connect_target, terminate

Sources = dict[tuple[int, int], str]  # (table OID, column number) -> the lower-case column name a rule names


def sources_query(names: Iterable[str]) -> str:
    """The catalog query for ``names`` (lower case), each a quoted literal."""
    literals = ", ".join("'" + name.replace("'", "''") + "'" for name in sorted(set(names)))
    return ("SELECT attrelid::oid::int8, attnum::int8, lower(attname::text) FROM pg_catalog.pg_attribute "
            f"WHERE attnum > 0 AND NOT attisdropped AND lower(attname::text) IN ({literals})")


async def column_sources(settings: TargetSettings, name: str, dialer: Dialer, names: Iterable[str]) -> Sources:
    """Every column of the target's database named one of ``names``, by (table OID, column number).

    Raises UpstreamError when the target cannot be asked (the relay then fails closed).
    """
    link = await connect_target(settings, {"application_name": "gatewayd-catalog"}, name, dialer=dialer)
    found: Sources = {}
    try:
        link.stream.write(encode_query(sources_query(names)))
        error: str | None = None
        while True:
            message = await link.stream.next_message()
            if message is None:
                raise UpstreamError(f'the target of connection "{name}" closed the catalog query')
            if isinstance(message, DataRow):
                relid, attnum, column = message.columns
                if relid is not None and attnum is not None and column is not None:
                    found[(int(relid), int(attnum))] = column.decode()
            elif isinstance(message, ErrorResponse):
                error = message.message
            elif isinstance(message, ReadyForQuery):
                break
        if error is not None:
            raise UpstreamError(f'the target of connection "{name}" refused the catalog query: {error}')
        return found
    finally:
        terminate(link)
