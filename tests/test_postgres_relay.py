"""Unit tests of the PostgreSQL relay's pure parts: block placement in pipelines, output cuts, rendering."""

from __future__ import annotations

import struct
import uuid
from collections import deque
from decimal import Decimal
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gatewayd.guardrails import ALLOWED, GuardVerdict, ObservedRules, RuleSet
from gatewayd.models import GuardRail
from gatewayd.policy import SessionPolicy
from gatewayd.sql.postgresql import POSTGRESQL
from proxies.postgres import codec as pg
from proxies.postgres.relay import (
    BLOCK,
    DROP,
    FORWARD,
    WAIT,
    ClientSide,
    ServerSide,
    WaitingClientSide,
)
from proxies.postgres.rendering import render_bind
from proxies.postgres.values import render_binary
from tests.test_masking import NO_CALLS


class FakeRecorder:
    """What the policy chain needs of a SessionRecorder: the three kinds of events and the cap flag."""

    def __init__(self, truncated: bool = False) -> None:
        self.truncated = truncated
        self.events: list[tuple[str, str]] = []

    def input(self, data):
        self.events.append(("i", data if isinstance(data, str) else bytes(data).decode()))

    def output(self, data):
        self.events.append(("o", data))

    def error(self, data):
        self.events.append(("e", data))


def rules(input_words: list[str] | None = None, output_pattern: str | None = None) -> RuleSet:
    rail = GuardRail(id="g", org_id="o", name="rail",
                     input={"rules": [{"type": "deny_words_list", "words": input_words}] if input_words else []},
                     output={"rules": [{"type": "pattern_match", "pattern_regex": output_pattern}]
                             if output_pattern else []})
    return RuleSet([rail], language=POSTGRESQL)


def sides(ruleset: RuleSet, recorder: FakeRecorder | None = None) -> tuple[ClientSide, ServerSide, FakeRecorder]:
    recorder = recorder or FakeRecorder()
    pending: deque = deque()
    columns: dict = {}
    policy = SessionPolicy(SimpleNamespace(recorder=recorder, client_ip=""), ruleset)  # type: ignore[arg-type]
    client = ClientSide(policy, pending, columns)
    client.mentions.learn(NO_CALLS)
    return client, ServerSide(policy, pending, columns), recorder


def frontend(*frames: bytes) -> list[pg.Message]:
    reader = pg.FrontendReader(expect_startup=False)
    reader.feed(b"".join(frames))
    return list(reader)


def answer(server: ServerSide, *frames: bytes) -> list[bytes]:
    """What the client receives for these target frames, one message per item."""
    reader = pg.BackendReader()
    reader.feed(b"".join(frames))
    batch = pg.FrameBatch()
    while True:
        server.process(reader, batch)
        if not server.blocks:
            break
        server.blocks.clear()
    out = pg.BackendReader()
    out.feed(b"".join(bytes(part) for part in batch.take()))
    return [bytes(m) for m in out]


def test_blocked_parse_in_a_pipeline_answers_in_order() -> None:
    client, server, recorder = sides(rules(["drop table"]))
    messages = frontend(pg.encode_parse("", "select 1"), pg.encode_bind("", ""), pg.encode_execute(),
                        pg.encode_parse("", "DROP  TABLE t"), pg.encode_bind("", ""), pg.encode_execute(),
                        pg.encode_sync())
    actions = [client.on_message(m) for m in messages]
    assert actions == [FORWARD, FORWARD, FORWARD, BLOCK, DROP, DROP, FORWARD]
    assert client.substitute.startswith(b"C")  # a Close of a statement that does not exist, then Flush
    error = pg.encode_error_response("ERROR", "42501", client.verdict.message)  # type: ignore[union-attr]
    target = [pg.encode_parse_complete(), pg.encode_bind_complete(), pg.encode_data_row([b"1"]),
              pg.encode_command_complete("SELECT 1"), pg.encode_close_complete(), pg.encode_ready_for_query("I")]
    assert answer(server, *target) == [*target[:4], error, target[5]]
    assert recorder.events == [("i", "select 1"), ("i", "DROP  TABLE t"), ("o", "1\nSELECT 1\n")]


def test_marker_is_dropped_when_the_target_already_failed_the_batch() -> None:
    client, server, _ = sides(rules(["drop table"]))
    for message in frontend(pg.encode_parse("", "select nope"), pg.encode_parse("", "drop table t"), pg.encode_sync()):
        client.on_message(message)
    failure = pg.encode_error_response("ERROR", "42703", 'column "nope" does not exist')
    assert answer(server, failure, pg.encode_ready_for_query("I")) == [failure, pg.encode_ready_for_query("I")]
    assert not server.pending


def test_blocked_simple_query_becomes_a_sync_and_keeps_the_transaction_status() -> None:
    client, server, recorder = sides(rules(["drop table"]))
    assert client.on_message(frontend(pg.encode_query("drop table t"))[0]) == BLOCK
    assert recorder.events == [("i", "drop table t")]  # on the record; the session adds the block's ``e``
    assert client.substitute == pg.encode_sync()
    error = pg.encode_error_response("ERROR", "42501", client.verdict.message)  # type: ignore[union-attr]
    assert answer(server, pg.encode_ready_for_query("T")) == [error, pg.encode_ready_for_query("T")]


class Decider:
    """The decider side of a sync AI rule's session analysis: a verdict per text, known once ``decide`` ran."""

    sync = True

    def __init__(self, refuse: str) -> None:
        self.refuse = refuse
        self.decided: set[str] = set()
        self.observed: list[str] = []

    def __call__(self, text: str) -> None:
        self.observed.append(text)

    def needs_wait(self, text: str) -> bool:
        return text not in self.decided

    async def decide(self, text: str, ask: bool) -> None:
        self.decided.add(text)

    def ruling(self, text: str) -> GuardVerdict:
        if self.refuse in text:
            return GuardVerdict(False, "blocked by AI session analysis (rule 'r'): high risk, X: Y", "input",
                                "ai_analysis", "r", text, analysis=object())
        return ALLOWED


async def test_a_statement_waiting_for_its_verdict_is_held_untouched_then_forwarded_or_blocked() -> None:
    recorder = FakeRecorder()
    pending: deque = deque()
    policy = SessionPolicy(SimpleNamespace(recorder=recorder, client_ip=""),  # type: ignore[arg-type]
                           ObservedRules(rules(["drop table"]), Decider("secret")))
    assert policy.waits
    client, server = WaitingClientSide(policy, pending, {}), ServerSide(policy, pending, {})
    query, parse, bind, execute, sync = frontend(
        pg.encode_query("select 1"), pg.encode_parse("", "select secret"), pg.encode_bind("", ""),
        pg.encode_execute(), pg.encode_sync())
    assert client.on_message(query) == WAIT and client.waiting == "select 1"
    assert not pending and not recorder.events  # nothing recorded or queued for a held message
    await policy.decide("select 1")
    assert client.on_message(query) == FORWARD and recorder.events == [("i", "select 1")]
    assert client.on_message(parse) == WAIT and client.waiting == "select secret"
    await policy.decide("select secret")
    assert [client.on_message(m) for m in (parse, bind, execute, sync)] == [BLOCK, DROP, DROP, FORWARD]
    error = pg.encode_error_response("ERROR", "42501", client.verdict.message)  # type: ignore[union-attr]
    target = [pg.encode_command_complete("SELECT 1"), pg.encode_ready_for_query("I"), pg.encode_close_complete(),
              pg.encode_ready_for_query("I")]
    assert answer(server, *target) == [*target[:2], error, target[3]]
    assert client.on_message(parse) == BLOCK  # the same SQL again: decided, not held
    assert ClientSide(policy, pending, {}).on_message(query) == FORWARD  # the ordinary side never waits


def test_output_rule_cuts_the_result_and_swallows_until_ready() -> None:
    client, server, recorder = sides(rules(output_pattern=r"secret-\d"))
    client.on_message(frontend(pg.encode_query("select v from t; select 2"))[0])
    rows = [pg.encode_row_description(["v"]), pg.encode_data_row([b"public"]), pg.encode_data_row([b"secret-1"]),
            pg.encode_data_row([b"public"]), pg.encode_command_complete("SELECT 3"),
            pg.encode_row_description(["x"]), pg.encode_data_row([b"2"]), pg.encode_command_complete("SELECT 1"),
            pg.encode_ready_for_query("I")]
    received = answer(server, *rows)
    assert received[:2] == rows[:2] and received[-1] == rows[-1] and len(received) == 4
    assert pg.decode_backend(received[2]).sqlstate == "42501"
    assert recorder.events == [("i", "select v from t; select 2"), ("o", "v\npublic\n")]


def test_rows_are_not_rendered_past_the_recording_cap_without_output_rules() -> None:
    _, server, recorder = sides(rules(), FakeRecorder(truncated=True))
    rows = [pg.encode_row_description(["v"]), pg.encode_data_row([b"x"]), pg.encode_command_complete("SELECT 1")]
    assert answer(server, *rows) == rows
    assert recorder.events == []


def test_bind_is_recorded_with_its_parameters() -> None:
    bind = frontend(pg.encode_bind("", "s", [b"42", None, b"\x00\x01", "it's"], [0, 0, 1, 0]))[0]
    assert render_bind("select $1, $2, $3, $4", bind) == (
        "select $1, $2, $3, $4\n-- parameters: $1 = '42', $2 = NULL, $3 = '\\x0001', $4 = 'it''s'")


@pytest.mark.parametrize("oid, raw, text", [
    (23, struct.pack("!i", -7), "-7"), (20, struct.pack("!q", 1 << 40), str(1 << 40)), (16, b"\x01", "t"),
    (701, struct.pack("!d", 0.5), "0.5"), (25, "naïve".encode(), "naïve"), (3802, b'\x01{"a": 1}', '{"a": 1}'),
    (2950, uuid.UUID(int=5).bytes, str(uuid.UUID(int=5))),
    (1700, struct.pack("!hhHhHH", 2, 0, 0, 4, 12, 3400), str(Decimal("12.3400"))),
    (1082, struct.pack("!i", 1), "2000-01-02"), (17, b"\xff", "\\xff"),
])
def test_binary_values_render_by_type(oid: int, raw: bytes, text: str) -> None:
    assert render_binary(oid, raw) == text


def test_row_description_summary_and_frame_batch() -> None:
    fields = [pg.FieldDescription("id", 1, 1, 23, 4, -1, 1), pg.FieldDescription("naïve", 0, 0, 25, -1, -1, 0)]
    message = pg.decode_backend(pg.encode_row_description(fields))
    assert message.summary() == (["id", "naïve"], (23, 25), (1, 0))
    reader = pg.BackendReader()
    reader.feed(pg.encode_data_row([b"1"]) + pg.encode_data_row([b"2"]) + pg.encode_command_complete("SELECT 2"))
    first, second, done = list(reader)
    batch = pg.FrameBatch()
    for item in (first, second, b"injected", done):
        batch.add_bytes(item) if isinstance(item, bytes) else batch.add(item)
    assert [bytes(p) for p in batch.take()] == [bytes(first) + bytes(second), b"injected", bytes(done)]
    assert not batch


def test_tls_certificate_is_generated_once_or_taken_from_the_configuration(tmp_path) -> None:
    from proxies.postgres import tls

    context = tls.server_context(tmp_path)
    generated = (tmp_path / tls.CERT_NAME).read_bytes()
    assert context is not None and (tmp_path / tls.KEY_NAME).stat().st_mode & 0o077 == 0
    tls.server_context(tmp_path)
    assert (tmp_path / tls.CERT_NAME).read_bytes() == generated  # kept, not regenerated
    elsewhere = tmp_path / "configured"
    tls.generate_self_signed(elsewhere / "a.crt", elsewhere / "a.key")
    assert tls.certificate_paths(tmp_path, str(elsewhere / "a.crt"), str(elsewhere / "a.key")) == (
        elsewhere / "a.crt", elsewhere / "a.key")
    with pytest.raises(ValueError, match="set both or neither"):
        tls.server_context(tmp_path, str(elsewhere / "a.crt"), "")


def test_a_column_masked_by_name_is_found_by_its_source_and_unknown_sources_mask_everything() -> None:
    rail = GuardRail(id="g", org_id="o", name="rail", input={"rules": []},
                     output={"rules": [{"type": "mask", "columns": ["ssn"], "style": "last4"}]})
    frames = (pg.encode_row_description([pg.FieldDescription("x", table_oid=16384, column=3),
                                         pg.FieldDescription("note", table_oid=16384, column=2)]),
              pg.encode_data_row([b"078-05-1120", b"hello"]), pg.encode_command_complete("SELECT 1"),
              pg.encode_ready_for_query("I"))

    def cells(sources) -> list[bytes | None]:
        recorder = FakeRecorder()
        recorder.metrics = {}  # the masked-value count
        _, server, _ = sides(RuleSet([rail]), recorder)
        server.sources = sources
        reader = pg.BackendReader()
        reader.feed(b"".join(answer(server, *frames)))
        [row] = [m for m in reader if isinstance(m, pg.DataRow)]
        return row.columns

    assert cells({(16384, 3): "ssn"}) == [b"*******1120", b"hello"]  # the alias "x" is the column ssn
    assert cells({(16384, 9): "ssn"}) == [b"078-05-1120", b"hello"]  # another table's column: not this one
    assert cells(None) == [b"*******1120", b"*ello"]  # the catalog could not be read: every value masked


_CELL = st.one_of(st.none(), st.text(max_size=12).map(lambda text: text.encode("utf-8", "surrogatepass")))
_RESULT = st.tuples(st.integers(1, 3), st.integers(0, 4), st.data())


def _target_answer(draw_results: list, data) -> list[bytes]:
    """Frames a target might answer a simple query with: results, an error, notices, an empty query."""
    frames: list[bytes] = []
    for columns, rows, _ in draw_results:
        kind = data.draw(st.sampled_from(["rows", "rows", "error", "notice", "empty"]))
        if kind == "error":
            frames.append(pg.encode_error_response("ERROR", "42P01", data.draw(st.text(max_size=20))))
            break  # the target skips the rest of the query string
        if kind == "notice":
            frames.append(pg.encode_notice_response("NOTICE", "00000", data.draw(st.text(max_size=20))))
        elif kind == "empty":
            frames.append(pg.encode_empty_query_response())
            continue
        frames.append(pg.encode_row_description([f"c{i}" for i in range(columns)]))
        frames += [pg.encode_data_row([data.draw(_CELL) for _ in range(columns)]) for _ in range(rows)]
        frames.append(pg.encode_command_complete(f"SELECT {rows}"))
    frames.append(pg.encode_ready_for_query("I"))
    return frames


@settings(max_examples=150, deadline=None)
@given(st.lists(_RESULT, min_size=1, max_size=4), st.data())
def test_recording_after_the_send_records_what_recording_before_it_did(results, data) -> None:
    """``records_later`` (what a relay session uses when only the recording reads the rows): the client gets the
    same frames and the recording the same events, in the same order, whatever the reads' boundaries."""
    frames = _target_answer(results, data)
    wire = b"".join(frames)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=4)))
    seen = {}
    for later in (False, True):
        client, server, recorder = sides(rules(["drop table"]))
        server.records_later = later
        client.on_message(frontend(pg.encode_query("select 1; select 2; select 3; select 4"))[0])
        reader, batch, sent = pg.BackendReader(), pg.FrameBatch(), b""
        for start, end in zip([0, *cuts], [*cuts, len(wire)]):
            reader.feed(wire[start:end])
            recorded = len(recorder.events)
            server.process(reader, batch)
            sent += b"".join(bytes(part) for part in batch.take())
            if later:
                assert len(recorder.events) == recorded, "nothing is recorded before the send"
                server.record_later()
        server.flush_output()
        seen[later] = (sent, recorder.events)
    assert seen[True] == seen[False] and seen[True][0] == wire


def test_a_malformed_row_seen_after_the_send_ends_the_relay_with_a_protocol_error() -> None:
    """Recording after the send: the row's frame went out as it came; rendering it raises, as before the change
    reading it did, and the rows before it are recorded."""
    client, server, recorder = sides(rules())
    server.records_later = True
    client.on_message(frontend(pg.encode_query("select v from t"))[0])
    bad = pg.encode_message(b"D", struct.pack("!hi", 1, 10) + b"abc")  # says 10 bytes, has 3
    reader, batch = pg.BackendReader(), pg.FrameBatch()
    reader.feed(pg.encode_row_description(["v"]) + pg.encode_data_row([b"ok"]) + bad)
    server.process(reader, batch)
    assert b"".join(bytes(part) for part in batch.take()).endswith(bad)
    with pytest.raises(pg.ProtocolError):
        server.record_later()
    server.flush_output()
    assert recorder.events == [("i", "select v from t"), ("o", "v\nok\n")]
