"""PostgreSQL as a SQL dialect (gatewayd.languages.SqlDialect): its scanner, its parser, its typed secrets.

The reading itself lives beside it: ``pg_scan`` (what deny words and patterns
read), ``pg_statements`` (what statement rules read), ``pg_escapes`` (the
reading under ``standard_conforming_strings = off``).
"""

from __future__ import annotations

import re

from gatewayd.languages import SQL, Language, ParsedStatement
from gatewayd.sql import pg_scan, pg_statements

_PASSWORD = re.compile(r"(\bpassword\s+)(E?'(?:[^']|'')*'|\$\w*\$.*?\$\w*\$)", re.I | re.S)
REDACTED = "[REDACTED]"


class PostgresDialect:
    """PostgreSQL's reading of SQL, through pglast (libpg_query: PostgreSQL's own scanner and parser)."""

    name = "postgresql"
    title = "PostgreSQL SQL"
    comment_gap = pg_scan.COMMENT_GAP

    kinds = pg_statements.statement_node_names()

    def needs_scan(self, text: str) -> bool:
        return pg_scan.needs_scan(text)

    def normalize(self, text: str) -> str:
        return pg_scan.normalize_sql(text)

    def parse(self, text: str) -> tuple[ParsedStatement, ...] | None:
        return pg_statements.parse_statements(text)

    def split(self, text: str) -> list[str]:
        return pg_statements.split_statements(text)

    def redact(self, text: str) -> str:
        return _PASSWORD.sub(lambda m: m.group(1) + f"'{REDACTED}'", text)


POSTGRESQL_DIALECT = PostgresDialect()
POSTGRESQL = Language("postgresql", SQL, POSTGRESQL_DIALECT.title, POSTGRESQL_DIALECT)
