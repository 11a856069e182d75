"""The relay's own CPU per pgbench ``-S`` transaction (simple, extended, prepared), without sockets.

Both sides of the PostgreSQL relay (``ClientSide`` and ``ServerSide``, the code
the proxy runs per message) on the frames of a pgbench transaction, with the
benchmark's two input rules and the recording on (a recorder that keeps
nothing).  CPU time (``process_time``), min of five repeats; compare trees in one sitting.

    .venv/bin/python bench/postgres/bench_relay.py

``BENCH_TREE=<a checkout>`` runs another tree's relay under this harness (compare trees with one harness);
``callgrind_relay.py`` counts the same loop's instructions.
"""
import os
import sys
import time
import timeit
from pathlib import Path
from collections import deque
from types import SimpleNamespace
ROOT = Path(os.environ.get("BENCH_TREE") or Path(__file__).resolve().parents[2]).resolve()
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gatewayd.guardrails import RuleSet  # noqa: E402
from gatewayd.models import GuardRail
from gatewayd.policy import SessionPolicy
from proxies.postgres import codec as pg
from proxies.postgres.relay import ClientSide, ServerSide

class Rec:
    truncated = False
    def __init__(self): self.metrics = {}; self.n = 0
    def input(self, d): self.n += 1
    output = error = record = input
    needs_drain = False

rail = GuardRail(id="g", org_id="o", name="bench", input={"rules": [
    {"type": "deny_words_list", "words": ["drop table", "truncate"]},
    {"type": "pattern_match", "pattern_regex": "(?i)delete\\s+from\\s+\\w+\\s*;"}]}, output={"rules": []})
try:  # a rule set reads its connection's language (before the dialect seam: the relay asked with sql=True)
    from gatewayd.sql.postgresql import POSTGRESQL
    rules = RuleSet([rail], language=POSTGRESQL)
except (ImportError, TypeError):  # TypeError: a tree with the module whose RuleSet took no language yet
    rules = RuleSet([rail])
rec = Rec()
policy = SessionPolicy(SimpleNamespace(recorder=rec, client_ip="", id="s"), rules)  # type: ignore[arg-type]


def make(pending, columns):
    return ClientSide(policy, pending, columns), ServerSide(policy, pending, columns)


row_desc = pg.encode_row_description([pg.FieldDescription("abalance", type_oid=23)])
def answer(mode):
    head = {"simple": row_desc, "prepared": b"2\x00\x00\x00\x04",  # RowDescription; BindComplete
            "extended": b"1\x00\x00\x00\x04" + b"2\x00\x00\x00\x04" + row_desc}[mode]  # ParseComplete, BindComplete
    return head + pg.encode_data_row(["-2612"]) + pg.encode_command_complete("SELECT 1") + pg.encode_ready_for_query()

def frames_simple(i):
    return pg.encode_query(f"SELECT abalance FROM pgbench_accounts WHERE aid = {i};")

def prepare(mode, n):
    """The measured loop for ``mode`` over ``n`` transactions (a fresh session, its statement prepared)."""
    pending, columns = deque(), {}
    client, server = make(pending, columns)
    fr = pg.FrontendReader(expect_startup=False)
    if mode == "prepared":
        # one Parse+Describe first (as pgbench -M prepared), then Bind/Execute/Sync per transaction
        sql = "SELECT abalance FROM pgbench_accounts WHERE aid = $1;"
        fr.feed(pg.encode_parse("P0_1", sql, [23]) + pg.encode_sync())
        for m in fr: client.on_message(m)
        br = pg.BackendReader(); b = pg.FrameBatch(); br.feed(b"1\x00\x00\x00\x04" + pg.encode_ready_for_query()); server.process(br, b); b.take()
    msgs = []
    for i in range(n):
        if mode == "simple":
            msgs.append(frames_simple(i % 100000))
        elif mode == "extended":  # pgbench -M extended: the unnamed statement parsed again every time
            msgs.append(pg.encode_parse("", "SELECT abalance FROM pgbench_accounts WHERE aid = $1;", [])
                        + pg.encode_bind("", "", [str(i).encode()], [0], [0]) + pg.encode_describe("P", "")
                        + pg.encode_execute("", 0) + pg.encode_sync())
        else:
            msgs.append(pg.encode_bind("", "P0_1", [str(i).encode()], [0], [0]) + pg.encode_execute("", 0) + pg.encode_sync())
    reply = answer(mode)
    br = pg.BackendReader()
    def go():
        for data in msgs:
            fr.feed(data)
            for m in fr:
                client.on_message(m)
            br.feed(reply)
            b = pg.FrameBatch(); server.process(br, b); b.take()
    return go


def run(mode, n=20000):
    t = min(timeit.repeat(prepare(mode, n), number=1, repeat=5, timer=time.process_time))
    return t / n * 1e6


if __name__ == "__main__":
    print({mode: round(run(mode), 2) for mode in ("simple", "extended", "prepared")})
