"""MySQL / MariaDB as a SQL dialect (gatewayd.languages.SqlDialect): its scanner, its parser, its typed secrets.

The reading lives beside it: ``mysql_scan`` (what deny words and patterns
read, the executable comments, quoting), ``mysql_statements`` (what statement
rules read, through sqlparser-rs's MySQL grammar).  A text is read here in the
server's default ``sql_mode`` with its executable comments read every way a
server of any version might; the MySQL proxy hands the rules the readings of
its session instead (its ``sql_mode``, its server's version:
proxies/mysql/reading.py), written in the canonical form this dialect reads
the same way.
"""

from __future__ import annotations

import re

from gatewayd.languages import SQL, Language
from gatewayd.sql import mysql_scan, mysql_statements
from gatewayd.languages import ParsedStatement

_SECRET = re.compile(r"""(\b(?:identified\s+(?:with\s+\S+\s+)?(?:by|as)|password\s*(?:\(|=)\s*(?:password\s*\()?)\s*)"""
                     r"""('(?:[^'\\]|\\.|'')*'|"(?:[^"\\]|\\.|"")*")""", re.I | re.S)
REDACTED = "[REDACTED]"
# between two words of a deny word, in raw SQL: whitespace or anything MySQL could read as a comment
COMMENT_GAP = "(?:[\\t\\n\\v\\f\\r ]|/\\*(?s:.*?)\\*/|#[^\\n]*|--[\\x00-\\x20][^\\n]*)+"


class MySQLDialect:
    """MySQL's and MariaDB's reading of SQL: a scanner that follows their lexer, sqlparser-rs's MySQL grammar."""

    name = "mysql"
    title = "MySQL SQL"
    comment_gap = COMMENT_GAP

    @property
    def kinds(self) -> tuple[str, ...]:
        return mysql_statements.statement_kinds()

    def needs_scan(self, text: str) -> bool:
        return mysql_scan.needs_scan(text)

    def normalize(self, text: str) -> str:
        return mysql_scan.normalize(text)

    def parse(self, text: str) -> tuple[ParsedStatement, ...] | None:
        return mysql_statements.parse_statements(text)

    def split(self, text: str) -> list[str]:
        return mysql_statements.split_statements(text)

    def redact(self, text: str) -> str:
        return _SECRET.sub(lambda m: m.group(1) + f"'{REDACTED}'", text)


MYSQL_DIALECT = MySQLDialect()
MYSQL = Language("mysql", SQL, MYSQL_DIALECT.title, MYSQL_DIALECT)
