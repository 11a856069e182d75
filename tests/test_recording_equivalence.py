"""What an auditor sees of a PostgreSQL session, held to a golden file: any change of rendering fails here.

A fixed workload goes through a real gatewayd to the suite's PostgreSQL 15:
psql (simple protocol: DDL, COPY FROM STDIN, a masked SELECT, an error, a
guard-rail block, an output cut, COPY TO STDOUT masked, PREPARE/EXECUTE, a
multi-statement query) and asyncpg (extended protocol: bind parameters in
binary, binary results, a named prepared statement executed again, binary COPY
in, COPY out in CSV, an error, a blocked Parse, a cut inside an Execute).  For
each session the recorded ``i``/``o``/``e`` events, ``?format=json`` and
``?format=csv``, ``?event_stream=utf8``, the asciicast export's answer (ssh
sessions only: a 422 for these), the session's metrics and the
``guardrail.block`` audit entries are compared with ``golden/recording_equivalence.json``,
written from the gateway as it rendered before the data-path work (issue 16).
Only what truly varies is normalised: times, offsets, ids, the connection's name.  The asyncpg side
avoids array types (asyncpg would introspect them with queries of its own); the COPY statement
``copy_records_to_table`` writes is asyncpg's, so a new asyncpg release may need the file regenerated.

Regenerate (only when a change of what auditors see is intended, and say so in the commit):
``GATEWAYD_WRITE_GOLDEN=1 .venv/bin/pytest tests/test_recording_equivalence.py``.
"""

from __future__ import annotations

import asyncio
import base64
import csv
import io
import json
import os
import subprocess
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from tests import clients
from tests.apiclient import PostgresApi, admin_http
from tests.conftest import HOT_PATH_RUNS, hot_path_logged, proxy_daemon
from tests.pgpeer import unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")

GOLDEN = Path(__file__).resolve().parent / "golden" / "recording_equivalence.json"
TABLE = "equiv_people"  # the suite's cluster is shared: a name of this module's own

INPUT_RULES = [{"type": "deny_words_list", "words": ["drop table", "truncate"]},
               {"type": "pattern_match", "pattern_regex": "(?i)delete\\s+from\\s+\\w+\\s*;"}]
OUTPUT_RULES = [{"type": "pattern_match", "pattern_regex": "SECRET-CUT"},
                {"type": "mask", "patterns": ["email", "card_number"]}]

PSQL_SCRIPT = f"""\
set timezone = 'UTC';
create table {TABLE} (id int primary key, name text, email text, note text, amount numeric(10,2), seen timestamptz,
                      flags bool[], doc jsonb);
insert into {TABLE} values
  (1, 'Ada', 'ada@example.com', 'paid with 4111111111111111', 12.50, '2024-05-17 10:21:33.123+00', '{{t,f}}',
   '{{"mail": "ada@example.com", "n": 1}}'),
  (2, 'Bob', 'none', 'SECRET-CUT here', 1.00, '2023-01-02 03:04:05+00', null, null);
copy {TABLE} (id, name, email, note, amount, seen) from stdin;
3\tCy\tcy@example.org\tcopied in\t3.25\t2024-01-01 00:00:00+00
4\tDi\t\\N\ttab\\tinside\t-0.50\t2022-12-31 23:59:59.999999+00
\\.
select id, name, email, note, amount, seen, flags, doc from {TABLE} where id <> 2 order by id;
select 1/0;
drop table {TABLE};
select id, note from {TABLE} order by id;
copy (select id, email, note from {TABLE} where id <> 2 order by id) to stdout;
copy (select id, name from {TABLE} where id <> 2 order by id) to stdout with (format csv, header);
prepare by_id(int) as select name, email from {TABLE} where id = $1;
execute by_id(1);
execute by_id(3);
select 'multi' as a; select 2 as b, null as c;
select '';
"""


def psql(port: int, secret: str, script: str) -> subprocess.CompletedProcess[str]:
    return clients.psql(port, secret, "-v", "ON_ERROR_STOP=0", "-f", "-", stdin=script)


async def asyncpg_workload(port: int, secret: str) -> list[str]:
    """The extended protocol's side of the workload; what the client saw, for the golden file too."""
    seen: list[str] = []
    connection = await asyncpg.connect(host="127.0.0.1", port=port, user=secret, password="any",
                                       database="postgres", timeout=15)
    try:
        await connection.execute("set timezone = 'UTC'")
        # no array types: asyncpg would introspect them with queries of its own, which change with its releases
        rows = await connection.fetch(f"select id, name, email, amount, seen, doc from {TABLE} "
                                      "where id in ($1, $2) and name <> $3 order by id", 1, 3, "it's")
        seen.append(repr([tuple(r) for r in rows]))
        statement = await connection.prepare(f"select name, email, amount from {TABLE} where id = $1")
        for i in (1, 3, 4):
            seen.append(repr(tuple(await statement.fetchrow(i) or ())))
        await connection.copy_records_to_table(TABLE, columns=["id", "name", "email", "note", "amount", "seen", "doc"],
                                               records=[(5, "Eve", "eve@example.net", "binary copy", Decimal("7.75"),
                                                         datetime(2024, 2, 29, 12, tzinfo=UTC), '{"k": "v"}')])
        out = io.BytesIO()
        await connection.copy_from_query(f"select id, name, email from {TABLE} where id in (1, 5) order by id",
                                         output=out, format="csv")
        seen.append(out.getvalue().decode())
        for sql, args in ((f"select * from no_such_{TABLE}", ()), (f"truncate {TABLE}", ()),
                          (f"select id, note from {TABLE} where id = $1", (2,))):
            try:
                await connection.fetch(sql, *args)
                seen.append(f"{sql}: no error")
            except asyncpg.PostgresError as exc:
                seen.append(f"{sql}: {exc.sqlstate} {exc}")
        seen.append(repr(await connection.fetchval("select $1::text || $2::int", "after", 7)))
    finally:
        await connection.close()
    return seen


def write_csv(rows: list[list[str]]) -> str:
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\r\n").writerows(rows)
    return buffer.getvalue()


class Normal:
    """Replaces what varies from run to run (ids, names, times) by fixed placeholders."""

    def __init__(self, **values: str) -> None:
        self.values = {v: f"<{k}>" for k, v in values.items() if v}

    def __call__(self, value: Any) -> Any:
        if isinstance(value, str):
            for raw, placeholder in self.values.items():
                value = value.replace(raw, placeholder)
            return value
        if isinstance(value, list):
            return [self(v) for v in value]
        if isinstance(value, dict):
            return {k: self(v) for k, v in value.items()}
        return value


async def auditor_view(api: PostgresApi, session_id: str, normal: Normal) -> dict[str, Any]:
    """Everything the API shows an auditor of one finished session, normalised."""
    session = await api.done_session(session_id, timeout=30)
    view: dict[str, Any] = {
        "events": [[kind, normal(base64.b64decode(data).decode("utf-8", "replace"))]
                   for _, kind, data in session["event_stream"]],
        "metrics": {k: v for k, v in sorted(session["metrics"].items()) if k in ("event_size", "masked", "truncated")},
        "exit_code": session["exit_code"],
    }
    status, statements = await api("GET", f"/sessions/{session_id}?format=json")
    assert status == 200, statements
    assert all(isinstance(s.pop("offset_ms"), int) for s in statements["statements"])
    view["format_json"] = normal({k: v for k, v in statements.items() if k not in ("start_date", "end_date")})
    async with api.http.get(f"{api.daemon.url}/sessions/{session_id}?format=csv") as response:
        assert response.status == 200 and response.content_type == "text/csv"
        text = await response.text()
    rows = list(csv.reader(io.StringIO(text)))
    assert rows[0][0] == "offset_ms" and all(row[0].isdigit() for row in rows[1:])
    assert write_csv(rows) == text  # the file as sent: what is compared below is it with its offsets normalised
    view["format_csv"] = normal(write_csv([rows[0]] + [["<offset>", *row[1:]] for row in rows[1:]]))
    status, utf8 = await api("GET", f"/sessions/{session_id}?event_stream=utf8")
    assert status == 200
    view["event_stream_utf8"] = normal(utf8["event_stream"])
    status, cast = await api("GET", f"/sessions/{session_id}?event_stream=asciicast")
    view["asciicast"] = [status, normal(cast)]
    status, logs = await api("GET", "/audit/logs?action=guardrail.block&page_size=100")
    assert status == 200
    view["audit"] = [normal({k: e[k] for k in ("action", "resource_type", "outcome", "error_message",
                                               "request_payload_redacted", "http_method", "http_path",
                                               "http_status")})
                     for e in reversed(logs["data"])
                     if (e["request_payload_redacted"] or {}).get("session_id") == session_id]
    return view


@pytest.fixture(scope="module", params=list(HOT_PATH_RUNS))
def gateway(request, tmp_path_factory):
    """Once on the hot path as built (compiled after make), once from the Python source (gatewayd/hotpath.py)."""
    env = HOT_PATH_RUNS[request.param]
    daemon = proxy_daemon(tmp_path_factory, "equivalence", "postgres", env=env)
    hot_path_logged(daemon, env)
    yield daemon
    assert daemon.stop() == 0


async def test_what_an_auditor_sees_is_unchanged(gateway, pg_target):
    """The workload twice: under input and output rules (rows read by the rules and masked as they pass), and
    under the input rules alone (rows read only by the recording, after they were sent: ``records_later``)."""
    document: dict[str, Any] = {}
    async with admin_http(gateway) as http:
        api = PostgresApi(gateway, http, pg_target)
        for suffix, output_rules in (("", OUTPUT_RULES), (" (input rules only)", [])):
            cleanup = await asyncpg.connect(pg_target.dsn())
            try:
                await cleanup.execute(f"drop table if exists {TABLE}")
            finally:
                await cleanup.close()
            role = await api.role()
            status, rail = await api("POST", "/guardrails", {
                "name": f"equivalence{suffix and '-input'}", "connection_ids": [role["id"]],
                "input": {"rules": INPUT_RULES}, "output": {"rules": output_rules}})
            assert status == 201, rail
            secret, session_id = await api.credential(role)
            done = await asyncio.to_thread(psql, gateway.proxy_port, secret, PSQL_SCRIPT)
            normal = Normal(session=session_id, connection=role["name"], guardrail=rail["id"], secret=secret,
                            connection_id=role["id"])
            document["psql" + suffix] = {"client": {"stdout": done.stdout, "stderr": normal(done.stderr),
                                                    "returncode": done.returncode},
                                         **await auditor_view(api, session_id, normal)}
            secret, session_id = await api.credential(role)
            seen = await asyncpg_workload(gateway.proxy_port, secret)
            normal = Normal(session=session_id, connection=role["name"], guardrail=rail["id"], secret=secret,
                            connection_id=role["id"])
            document["asyncpg" + suffix] = {"client": normal(seen), **await auditor_view(api, session_id, normal)}
    text = json.dumps(document, indent=1, ensure_ascii=False, sort_keys=True) + "\n"
    # what is masked never reaches an auditor's output events in clear
    for name in ("psql", "asyncpg"):
        shown = "".join(text for kind, text in document[name]["events"] if kind == "o")
        for clear in ("ada@example.com", "4111111111111111", "cy@example.org", "eve@example.net", "SECRET-CUT"):
            assert clear not in shown, (name, clear)
    if os.environ.get("GATEWAYD_WRITE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(text)
    golden = json.loads(GOLDEN.read_text())
    for name in golden:
        for key in golden[name]:
            assert document[name][key] == golden[name][key], f"{name}: {key} differs from {GOLDEN.name}"
    assert json.loads(text) == golden
