"""Statement-kind rules alone: CPU per statement of pgbench's statements, uncached and cached (by text).

Target (issue 13): under 15 us per statement uncached; a repeated statement
(the parse cache by text) about 1 us.  No server is started: this times
``RuleSet.check_input(sql)`` of a PostgreSQL rule set with only the statement rules, the
exact call the PostgreSQL proxy makes per Query and per Parse.

    .venv/bin/python bench/postgres/bench_statement_rules.py [--number 2000]
"""

from __future__ import annotations

import argparse
import sys
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pglast import parser as pg_parser  # noqa: E402

from gatewayd import guardrails  # noqa: E402
from gatewayd.models import GuardRail  # noqa: E402

try:  # a rule set reads its connection's language (since the dialect seam of issue 32; before, ``sql=True``)
    from gatewayd.sql.postgresql import POSTGRESQL  # noqa: E402
    LANGUAGE, SQL = {"language": POSTGRESQL}, {}
except ImportError:
    LANGUAGE, SQL = {}, {"sql": True}
try:  # where the parse cache lives (gatewayd/sql/pg_statements.py since the readings of issue 29; before, guardrails)
    from gatewayd.sql.pg_statements import _parse_cached  # noqa: E402
except ImportError:  # a baseline tree from before (``PYTHONPATH=<old checkout>``)
    _parse_cached = guardrails._parse_cached  # type: ignore[attr-defined]

PGBENCH = [  # the TPC-B-like transaction of pgbench, and -S
    "BEGIN;",
    "UPDATE pgbench_accounts SET abalance = abalance + -4321 WHERE aid = 81234;",
    "SELECT abalance FROM pgbench_accounts WHERE aid = 81234;",
    "UPDATE pgbench_tellers SET tbalance = tbalance + -4321 WHERE tid = 7;",
    "UPDATE pgbench_branches SET bbalance = bbalance + -4321 WHERE bid = 1;",
    "INSERT INTO pgbench_history (tid, bid, aid, delta, mtime) VALUES (7, 1, 81234, -4321, CURRENT_TIMESTAMP);",
    "END;",
    "SELECT abalance FROM pgbench_accounts WHERE aid = $1",
]
RULES = [{"type": "statement_kinds", "deny": ["DropStmt", "TruncateStmt", "GrantStmt"]},
         {"type": "require_where", "statements": ["delete", "update"]}]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--number", type=int, default=2000)
    args = parser.parse_args()
    rules = guardrails.RuleSet([GuardRail(id="b", org_id="o", name="bench", input={"rules": RULES})],
                               **LANGUAGE)
    for sql in PGBENCH:
        assert rules.check_input(sql, **SQL).allowed, sql
    n = args.number

    def uncached() -> None:
        _parse_cached.cache_clear()
        for sql in PGBENCH:
            rules.check_input(sql, **SQL)

    def cached() -> None:
        for sql in PGBENCH:
            rules.check_input(sql, **SQL)

    per = len(PGBENCH) * n
    uncached_us = min(timeit.repeat(uncached, number=n, repeat=3)) / per * 1e6
    cached()
    cached_us = min(timeit.repeat(cached, number=n, repeat=3)) / per * 1e6
    floor_us = min(timeit.repeat(lambda: [pg_parser.parse_sql_json(sql) for sql in PGBENCH], number=n,
                                 repeat=3)) / per * 1e6
    print(f"PostgreSQL's parser alone (pglast parse_sql_json): {floor_us:.1f} us per statement (the floor)")
    print(f"statement rules ({len(RULES)}) over {len(PGBENCH)} pgbench statements: "
          f"uncached {uncached_us:.1f} us, cached {cached_us:.2f} us per statement (target < 15 us, ~1 us)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
