"""What reading a statement costs under a mask rule by column name (proxies/postgres/computed.py): ``Mentions.read``
of ``N`` statements, each with its own constant, to run under callgrind against a run of none.

    valgrind --tool=callgrind --callgrind-out-file=/dev/null .venv/bin/python bench/postgres/mentions_loop.py N Q [--ask]

``Q`` picks the statement (0: pgbench's UPDATE, 1: its SELECT, 2: a join computing a value); ``--ask`` also works
out what is left for later (``bool`` of the answer, as a result with a computed column does). Run from the tree to
measure (``PYTHONPATH``), with ``GATEWAYD_PURE_PYTHON=1``.
"""

from __future__ import annotations

import sys

from proxies.postgres import computed

STATEMENTS = ("UPDATE pgbench_accounts SET abalance = abalance + -4321 WHERE aid = {};",
              "SELECT abalance FROM pgbench_accounts WHERE aid = {};",
              "select p.id, upper(p.name) from people p join orders o on o.person = p.id where o.total > {}")


def main() -> None:
    count, which, ask = int(sys.argv[1]), int(sys.argv[2]), "--ask" in sys.argv[3:]
    if hasattr(computed, "BuiltIns"):  # (a tree from before the built-ins were read has none)
        mentions = computed.Mentions(computed.BuiltIns(frozenset({"upper", "count", "lower", "now", "sum"}),
                                                       frozenset({"+", "=", "<", ">", "-"}), frozenset()))
    else:
        mentions = computed.Mentions()
    statement = STATEMENTS[which]
    mentions.read(statement.format(-1), {"ssn"})  # (imports and caches warmed)
    for i in range(count):
        answer = mentions.read(statement.format(i), {"ssn"})
        if ask:
            bool(answer)


if __name__ == "__main__":
    main()
