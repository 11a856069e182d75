"""Unit tests of masking: the detectors and their checks, the styles, rule validation, and the relay's cells."""

from __future__ import annotations

import dataclasses

import json
import struct
from collections import deque
from types import SimpleNamespace

import pytest

from gatewayd.guardrails import RuleError, RuleSet, validate_guardrail
from gatewayd.masking import MAX_HELD_LINE, LineHold, Masker, iban_valid, luhn_valid
from gatewayd.models import GuardRail
from gatewayd.policy import SessionPolicy
from proxies.postgres import codec as pg
from proxies.postgres.computed import BuiltIns
from proxies.postgres.relay import FORWARD, PREFIXED, ClientSide, ServerSide

KEY = b"k" * 32


def masker(*rules: dict, key: bytes = KEY) -> Masker:
    rail = GuardRail(id="g", org_id="o", name="rail", input={"rules": []}, output={"rules": list(rules)})
    found = RuleSet([rail], key).masker
    assert found is not None
    return found


def mask(text: str, *rules: dict) -> str:
    return masker(*rules).mask_text(text)[0]


# -- detectors and their checks


@pytest.mark.parametrize("number", ["4111111111111111", "5500005555555559", "378282246310005", "6011111111111117",
                                    "4111 1111 1111 1111", "4111-1111-1111-1111"])
def test_card_numbers_with_a_valid_luhn_check_are_masked(number: str) -> None:
    assert mask(f"paid with {number} today", {"type": "mask", "patterns": ["card_number"]}) == "paid with **** today"


@pytest.mark.parametrize("number", ["4111111111111112", "1234567890123", "5500005555555550",
                                    "41111111111111111111111"])  # bad checksum, or a digit run too long for a card
def test_digit_runs_that_fail_luhn_are_left_alone(number: str) -> None:
    assert mask(f"id {number}", {"type": "mask", "patterns": ["card_number"]}) == f"id {number}"


def test_luhn_and_iban_checks() -> None:
    assert luhn_valid("79927398713") and not luhn_valid("79927398710")
    assert iban_valid("GB82 WEST 1234 5698 7654 32") and iban_valid("DE89370400440532013000")
    assert iban_valid("FR1420041010050500013M02606")
    assert not iban_valid("GB82 WEST 1234 5698 7654 33") and not iban_valid("DE89370400440532013001")


def test_ibans_emails_and_national_ids() -> None:
    rule = {"type": "mask", "patterns": ["iban", "email", "us_ssn", "uk_nino", "fr_nir"]}
    assert mask("iban DE89370400440532013000 / DE89370400440532013001", rule) == \
        "iban **** / DE89370400440532013001"
    assert mask("write to jane.doe+x@mail.example.co.uk please", rule) == "write to **** please"
    assert mask("ssn 078-05-1120, not 000-12-3456 nor 666-12-3456 nor 900-12-3456", rule) == \
        "ssn ****, not 000-12-3456 nor 666-12-3456 nor 900-12-3456"
    assert mask("nino AB 12 34 56 C, never GB123456A", rule) == "nino ****, never GB123456A"
    # NIR: 1 84 12 76 451 089 key 46 (97 - 1841276451089 mod 97); a wrong key is left alone
    assert mask("nir 1 84 12 76 451 089 46 / 184127645108947", rule) == "nir **** / 184127645108947"
    assert mask("nir 2 69 05 2A 135 002 85", rule) == "nir ****"  # Corsica: 2A counts as 19


def test_custom_regex_and_overlaps() -> None:
    rule = {"type": "mask", "pattern_regex": "secret-[0-9]+", "patterns": ["email"]}
    assert mask("a secret-42 and secret-7@x.io", rule) == "a **** and ****"


# -- styles


def test_styles() -> None:
    assert mask("card 4111111111111111", {"type": "mask", "patterns": ["card_number"], "style": "last4"}) == \
        "card ************1111"
    one = mask("a@b.io", {"type": "mask", "patterns": ["email"], "style": "hash"})
    assert one.startswith("#") and len(one) == 17 and "a@b.io" not in one
    assert mask("x a@b.io y a@b.io", {"type": "mask", "patterns": ["email"], "style": "hash"}) == f"x {one} y {one}"
    other_key = masker({"type": "mask", "patterns": ["email"], "style": "hash"}, key=b"o" * 32)
    assert other_key.mask_text("a@b.io")[0] != one  # keyed: not a plain hash anyone could recompute
    import hashlib
    assert hashlib.sha256(b"a@b.io").hexdigest()[:16] not in one


def test_fast_path_says_no_without_a_candidate() -> None:
    m = masker({"type": "mask", "patterns": ["card_number", "email"]})
    assert not m.may_match(b"1\tplain text\t2024-01-01")
    assert m.may_match(b"1\tx@y.io") and m.mask(b"plain") is None


# -- rule validation (the API's 400)


@pytest.mark.parametrize("rule, named", [
    ({"type": "mask"}, "needs 'patterns', 'pattern_regex' or 'columns'"),
    ({"type": "mask", "patterns": ["phone"]}, "unknown pattern 'phone'"),
    ({"type": "mask", "patterns": ["email"], "style": "blur"}, "output.rules[0].style"),
    ({"type": "mask", "pattern_regex": "(a)\\1"}, "backreferences"),
    ({"type": "mask", "columns": [""]}, "output.rules[0].columns"),
    ({"type": "mask", "columns": ["a"], "record_clear": "yes"}, "output.rules[0].record_clear"),
])
def test_bad_mask_rules_are_refused_with_the_problem_named(rule: dict, named: str) -> None:
    with pytest.raises(RuleError, match=named.replace("(", "\\(").replace(")", "\\)").replace("[", "\\[")
                       .replace("]", "\\]")):
        validate_guardrail({"rules": []}, {"rules": [rule]})


def test_a_mask_rule_is_an_output_rule() -> None:
    with pytest.raises(RuleError, match="mask is an output rule"):
        validate_guardrail({"rules": [{"type": "mask", "patterns": ["email"]}]}, {"rules": []})


# -- the policy chain


class Recorder:
    def __init__(self) -> None:
        self.truncated = False
        self.events: list[tuple[str, str]] = []
        self.metrics: dict = {}

    def input(self, data):
        self.events.append(("i", data if isinstance(data, str) else bytes(data).decode()))

    def output(self, data):
        self.events.append(("o", data if isinstance(data, str) else bytes(data).decode()))

    def error(self, data):
        self.events.append(("e", data))


def policy_for(*rules: dict, recorder: Recorder | None = None) -> tuple[SessionPolicy, Recorder]:
    recorder = recorder or Recorder()
    rail = GuardRail(id="g", org_id="o", name="rail", input={"rules": []}, output={"rules": list(rules)})
    live = SimpleNamespace(recorder=recorder, client_ip="")
    return SessionPolicy(live, RuleSet([rail], KEY)), recorder  # type: ignore[arg-type]


def test_output_masked_records_and_counts_the_masked_text() -> None:
    policy, recorder = policy_for({"type": "mask", "patterns": ["email"]})
    verdict, text = policy.output_masked("mail a@b.io and c@d.io")
    assert verdict is None and text == "mail **** and ****"
    assert recorder.events == [("o", "mail **** and ****")] and recorder.metrics["masked"] == 2


def test_streams_are_held_to_line_ends_and_masked_after_what_was_shown() -> None:
    """SSH output and event streams: a value cut between two pieces is found whole; once a pause gave up
    an unfinished line, the rest of a value it began is still masked."""
    policy, _ = policy_for({"type": "mask", "patterns": ["card_number"]})
    hold = LineHold()
    assert hold.take(b"paid 4111 1111") == (b"", b"") and hold.pending
    ready, context = hold.take(b" 1111 1111 ok\r\nnext ")
    assert policy.mask_bytes(ready, context) == b"paid **** ok\r\n" and hold.pending
    assert hold.give_up() == (b"next ", b"")  # a pause: the unfinished line goes as it is
    assert hold.take(b"4111 1111") == (b"", b"next ")
    assert hold.give_up() == (b"4111 1111", b"next ")
    ready, context = hold.take(b" 1111 1111\n")
    assert context == b"next 4111 1111" and policy.mask_bytes(ready, context) == b"****\n"
    assert policy.live.recorder.metrics["masked"] == 2
    assert hold.take(b"x" * (MAX_HELD_LINE + 1))[0] == b"x" * (MAX_HELD_LINE + 1)  # bounded: given up
    assert policy.mask_bytes(b"\xff card 4111111111111111 \xfe") == b"\xff card **** \xfe"  # not UTF-8: kept


def test_a_deny_rule_still_cuts_beside_a_mask_rule() -> None:
    policy, recorder = policy_for({"type": "mask", "patterns": ["email"]},
                                  {"type": "pattern_match", "pattern_regex": "TOPSECRET"})
    verdict, _ = policy.output_masked("TOPSECRET a@b.io")
    assert verdict is not None and not verdict.allowed and recorder.events == []


# -- the PostgreSQL relay, per cell


# what the catalog said a statement may call, for relays fed by hand: nothing (their statements call nothing)
NO_CALLS = BuiltIns(frozenset(), frozenset(), frozenset())


def relay(*rules: dict) -> tuple[ClientSide, ServerSide, Recorder]:
    policy, recorder = policy_for(*rules)
    pending: deque = deque()
    columns: dict = {}
    client = ClientSide(policy, pending, columns)
    client.mentions.learn(NO_CALLS)
    return client, ServerSide(policy, pending, columns), recorder


def answer(server: ServerSide, *frames: bytes) -> list[pg.Message]:
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
    return list(out)


def field(name: str, oid: int, fmt: int = 0) -> pg.FieldDescription:
    return pg.FieldDescription(name, type_oid=oid, format=fmt)


def of_table(*fields: pg.FieldDescription, table: int = 16400) -> list[pg.FieldDescription]:
    """``fields`` as a table's columns, numbered in order (a column without a table is computed: one whose
    statement is unknown, or names a masked column, is masked whole)."""
    return [dataclasses.replace(f, table_oid=table, column=i) for i, f in enumerate(fields, 1)]


def rows_of(messages: list[pg.Message]) -> list[list[bytes | None]]:
    return [m.columns for m in messages if isinstance(m, pg.DataRow)]


def test_text_rows_are_masked_per_cell_by_pattern_and_by_column() -> None:
    _, server, recorder = relay({"type": "mask", "patterns": ["card_number", "email"]},
                                {"type": "mask", "columns": ["SSN"], "style": "last4"})
    out = answer(server,
                 pg.encode_row_description(of_table(field("id", 23), field("note", 25), field("ssn", 1043),
                                                     field("amount", 1700))),
                 pg.encode_data_row([b"1", b"card 4111111111111111", b"078-05-1120", b"4111111111111111"]),
                 pg.encode_data_row([b"2", b"nothing here", None, b"12.50"]),
                 pg.encode_command_complete("SELECT 2"), pg.encode_ready_for_query())
    assert rows_of(out) == [[b"1", b"card ****", b"*******1120", None], [b"2", b"nothing here", None, b"12.50"]]
    recorded = "".join(data for kind, data in recorder.events if kind == "o")
    assert "4111111111111111" not in recorded and "078-05-1120" not in recorded and "card ****" in recorded
    assert recorder.metrics["masked"] == 3


def test_binary_rows_keep_valid_values() -> None:
    _, server, _ = relay({"type": "mask", "patterns": ["card_number", "email"]},
                         {"type": "mask", "columns": ["secret_int", "doc"]})
    binary = 1
    out = answer(server,
                 pg.encode_row_description(of_table(field("mail", 25, binary), field("big", 20, binary),
                                                     field("secret_int", 23, binary), field("doc", 3802, binary),
                                                     field("j", 3802, binary))),
                 pg.encode_data_row([b"a@b.io", struct.pack("!q", 4111111111111111), struct.pack("!i", 7),
                                     b"\x01" + json.dumps({"k": 1}).encode(),
                                     b"\x01" + json.dumps({"m": "x@y.io", "n": 4111111111111111}).encode()]),
                 pg.encode_command_complete("SELECT 1"), pg.encode_ready_for_query())
    [row] = rows_of(out)
    assert row[0] == b"****" and row[1] is None and row[2] is None
    assert row[3] == b'\x01"****"'  # a masked jsonb column is still jsonb: a JSON string
    assert row[4] is None  # the card was a JSON number: masked text would not be JSON


def test_extended_protocol_masks_columns_by_the_statement_description() -> None:
    client, server, _ = relay({"type": "mask", "columns": ["email"]})
    for message in [pg.Parse(pg.encode_parse("s1", "select email, id from users")),
                    pg.Describe(pg.encode_describe("S", "s1")), pg.Sync(pg.encode_sync())]:
        client.on_message(message)
    answer(server, pg.encode_parse_complete(), pg.encode_parameter_description([]),
           pg.encode_row_description(of_table(field("email", 25), field("id", 23))), pg.encode_ready_for_query())
    actions = [client.on_message(message) for message in [
        pg.Bind(pg.encode_bind("", "s1", result_formats=[1])), pg.Execute(pg.encode_execute("")),
        pg.Sync(pg.encode_sync())]]
    # a named statement may have been replaced by SQL since: the gateway describes the portal before it runs
    assert actions == [FORWARD, PREFIXED, FORWARD] and client.substitute == pg.encode_describe("P", "")
    out = answer(server, pg.encode_bind_complete(),
                 pg.encode_row_description(of_table(field("email", 25, 1), field("id", 23, 1))),
                 pg.encode_data_row([b"x@y.io", struct.pack("!i", 5)]),
                 pg.encode_command_complete("SELECT 1"), pg.encode_ready_for_query())
    assert rows_of(out) == [[b"****", struct.pack("!i", 5)]]
    assert not any(isinstance(m, pg.RowDescription) for m in out)  # the gateway's own Describe is not answered


def test_an_execute_is_masked_by_what_its_portal_returns_now_not_by_an_earlier_description() -> None:
    """A statement described as harmless, replaced by SQL's PREPARE (the target's answer to the gateway's own
    Describe of the portal says so), is masked by its new columns; the unnamed statement is not described again."""
    client, server, _ = relay({"type": "mask", "columns": ["email"]})
    for message in [pg.Parse(pg.encode_parse("s1", "select id::text from users")),
                    pg.Describe(pg.encode_describe("S", "s1")), pg.Sync(pg.encode_sync())]:
        client.on_message(message)
    answer(server, pg.encode_parse_complete(), pg.encode_parameter_description([]),
           pg.encode_row_description([field("id", 25)]), pg.encode_ready_for_query())
    for message in [pg.Bind(pg.encode_bind("", "s1")), pg.Execute(pg.encode_execute("")), pg.Sync(pg.encode_sync())]:
        client.on_message(message)
    out = answer(server, pg.encode_bind_complete(), pg.encode_row_description([field("email", 25)]),
                 pg.encode_data_row([b"x@y.io"]), pg.encode_command_complete("SELECT 1"),
                 pg.encode_ready_for_query())
    assert rows_of(out) == [[b"****"]]
    unnamed = [client.on_message(message) for message in [
        pg.Parse(pg.encode_parse("", "select id::text from users")), pg.Bind(pg.encode_bind("", "")),
        pg.Execute(pg.encode_execute("")), pg.Sync(pg.encode_sync())]]
    assert unnamed == [FORWARD] * 4


def test_rows_without_a_known_description_are_masked_whole_under_a_column_rule() -> None:
    _, server, _ = relay({"type": "mask", "columns": ["email"]})
    out = answer(server, pg.encode_data_row([b"x@y.io", b"5"]), pg.encode_command_complete("SELECT 1"),
                 pg.encode_ready_for_query())
    assert rows_of(out) == [[b"****", b"****"]]


def test_copy_out_is_masked_in_text_and_cut_in_binary() -> None:
    _, server, recorder = relay({"type": "mask", "patterns": ["email"]})
    out = answer(server, pg.encode_copy_out_response(0, [0, 0]), pg.encode_copy_data(b"1\ta@b.io\n"),
                 pg.encode_copy_done(), pg.encode_command_complete("COPY 1"), pg.encode_ready_for_query())
    assert [bytes(m.data) for m in out if isinstance(m, pg.CopyData)] == [b"1\t****\n"]
    out = answer(server, pg.encode_copy_out_response(1, [1, 1]), pg.encode_copy_data(b"PGCOPY\n\xff..."),
                 pg.encode_copy_done(), pg.encode_command_complete("COPY 1"), pg.encode_ready_for_query())
    assert not any(isinstance(m, pg.CopyData) for m in out)
    assert any(isinstance(m, pg.ErrorResponse) and "binary COPY" in m.message for m in out)
    assert "a@b.io" not in "".join(data for _, data in recorder.events)


def test_cells_found_through_invalid_utf8_and_anchored_regexes() -> None:
    _, server, _ = relay({"type": "mask", "patterns": ["email"]}, {"type": "mask", "pattern_regex": "^k[0-9]+$"})
    out = answer(server,
                 pg.encode_row_description([field("a", 25), field("b", 25), field("c", 25), field("d", 25)]),
                 pg.encode_data_row([b"\xff\xfe bad bytes", b"k42", b"x k42", b"mail a@b.io"]),
                 pg.encode_data_row([b"a@b.io\tc@d.io", None, b"k7", b"plain"]),
                 pg.encode_command_complete("SELECT 2"), pg.encode_ready_for_query())
    # the first row's text is not its bytes (invalid UTF-8 replaced): the cells are searched themselves
    assert rows_of(out) == [[b"\xff\xfe bad bytes", b"****", b"x k42", b"mail ****"],
                            [b"****\t****", None, b"****", b"plain"]]


def test_cells_spanned_by_one_match_are_all_checked() -> None:
    m = masker({"type": "mask", "pattern_regex": "a[^z]*b"})
    cells = [b"xa", b"yb", b"ab"]  # the row's text "xa\tyb\tab" matches once, over all three cells
    assert m.candidate_cells(cells) == [0, 1, 2]
    assert [m.mask(c) for c in cells] == [None, None, (b"****", 1)]


def test_errors_notices_and_notifications_are_masked() -> None:
    _, server, recorder = relay({"type": "mask", "patterns": ["email"]})
    error = pg.encode_error_response("ERROR", "22P02", 'invalid input syntax for type integer: "a@b.io"',
                                     {"D": "Key (email)=(c@d.io) already exists."})
    out = answer(server, pg.encode_notice_response("NOTICE", "00000", "hello e@f.io"),
                 pg.encode_notification_response(7, "chan", "g@h.io"), error, pg.encode_ready_for_query())
    notice, notification, err, _ = out
    assert notice.message == "hello ****" and notification.payload == "****"
    assert err.message == 'invalid input syntax for type integer: "****"' and err.detail == "Key (email)=(****) already exists."
    assert err.sqlstate == "22P02"
    assert all("@" not in data for _, data in recorder.events) and recorder.metrics["masked"] == 4


def test_json_documents_by_key_and_by_pattern() -> None:
    m = masker({"type": "mask", "patterns": ["card_number", "email"]}, {"type": "mask", "columns": ["ssn", "card"]})
    doc = {"user": {"SSN": "078-05-1120", "mail": "write a@b.io", "age": 41, "card": {"number": 4111111111111111,
                                                                                     "holder": "J"}},
           "list": [4111111111111111, 4111111111111112, True, None]}
    masked, count = m.mask_json(doc)
    assert masked == {"user": {"SSN": "****", "mail": "write ****", "age": 41,
                               "card": {"number": None, "holder": "****"}},
                      "list": [None, 4111111111111112, True, None]}
    assert count == 5


def test_a_malformed_notification_is_a_protocol_error() -> None:
    _, server, _ = relay({"type": "mask", "patterns": ["email"]})
    with pytest.raises(pg.ProtocolError):
        answer(server, pg.encode_message(b"A", b"\x00\x00\x00\x07a@b.io"))  # no NUL after the channel


def test_an_execute_of_a_statement_never_described_is_masked_whole_under_a_column_rule() -> None:
    client, server, _ = relay({"type": "mask", "columns": ["email"]})
    answer(server, pg.encode_row_description([field("id", 23)]), pg.encode_data_row([b"1"]),
           pg.encode_command_complete("SELECT 1"), pg.encode_ready_for_query())  # another result, described
    for message in [pg.Parse(pg.encode_parse("s2", "select email from users")),
                    pg.Bind(pg.encode_bind("", "s2")), pg.Execute(pg.encode_execute("")), pg.Sync(pg.encode_sync())]:
        client.on_message(message)
    out = answer(server, pg.encode_parse_complete(), pg.encode_bind_complete(), pg.encode_data_row([b"x@y.io"]),
                 pg.encode_command_complete("SELECT 1"), pg.encode_ready_for_query())
    # the last description (id int) does not stand for this statement's columns: masked whole (fail closed)
    assert rows_of(out) in ([[b"****"]], [[None]])


@pytest.mark.parametrize(("pattern", "data"), [(b"a*", b"xaay"), (b"a*", b""), (b"x", b"xyx"), (b"", b"abc"),
                                               (b"\\b", b"ab cd"), (b"[0-9]+", b"12 ab 345"), (b"z", b"abc"),
                                               (b"x|$", b"ax"), (b"[a-z]+", b"ab cd")])
def test_the_raw_match_spans_are_those_of_finditer(pattern: bytes, data: bytes) -> None:
    """The finders' fast loop over google-re2's compiled expression finds what its ``finditer`` finds."""
    import re2

    from gatewayd.masking import _spans_of

    regex = re2.compile(pattern)
    assert _spans_of(regex)(data) == [match.span() for match in regex.finditer(data)]
    # a finder's: the same matches of some length
    assert [s for s in _spans_of(regex, nonempty=True)(data) if s[1] > s[0]] == \
        [match.span() for match in regex.finditer(data) if match.end() > match.start()]


def test_the_recorded_text_of_a_masked_row_is_the_rendering_of_the_masked_row() -> None:
    """The recording renders only the masked cells again: the same text as rendering the whole masked row."""
    from proxies.postgres.rendering import render_values

    _, server, recorder = relay({"type": "mask", "patterns": ["card_number", "email"]},
                                {"type": "mask", "columns": ["secret"], "style": "last4"})
    fields = of_table(field("id", 23), field("note", 25), field("secret", 25), field("mail", 25), field("n", 701))
    rows = [[b"1", b"card 4111111111111111", b"078-05-1120", b"a@b.io", b"1.5"],
            [b"2", b"tab\tin a@b.io cell", None, b"x\ty@z.io", None],  # tabs in cells: rendered whole again
            [b"3", b"\xff bad bytes c@d.io", b"k", None, b"2"],  # invalid UTF-8: the cells searched themselves
            [b"4", b"caf\xc3\xa9 e@f.io", b"\xc3\xa9t\xc3\xa9", b"", b"3"]]
    out = answer(server, pg.encode_row_description(fields), *(pg.encode_data_row(r) for r in rows),
                 pg.encode_command_complete("SELECT 4"), pg.encode_ready_for_query())
    masked = rows_of(out)
    assert masked[0][1:4] == [b"card ****", b"*******1120", b"****"] and masked[1][3] == b"x\t****"
    recorded = "".join(data for kind, data in recorder.events if kind == "o").split("\n")
    assert recorded[1:5] == [render_values(r, (0,) * 5, (23, 25, 25, 25, 701)) for r in masked]


def test_the_recorded_text_of_a_masked_binary_row_is_the_rendering_of_the_masked_row() -> None:
    from proxies.postgres.rendering import render_values

    _, server, recorder = relay({"type": "mask", "patterns": ["email"]}, {"type": "mask", "columns": ["k"]})
    binary = 1
    fields = of_table(field("id", 23, binary), field("note", 25, binary), field("k", 23, binary), field("t", 25))
    row = [struct.pack("!i", 7), b"mail a@b.io", struct.pack("!i", 42), b"x c@d.io"]
    out = answer(server, pg.encode_row_description(fields), pg.encode_data_row(row),
                 pg.encode_command_complete("SELECT 1"), pg.encode_ready_for_query())
    masked = rows_of(out)[0]
    assert masked == [struct.pack("!i", 7), b"mail ****", None, b"x ****"]
    recorded = "".join(data for kind, data in recorder.events if kind == "o").split("\n")
    assert recorded[1] == render_values(masked, (binary, binary, binary, 0), (23, 25, 23, 25))


@pytest.mark.parametrize("values", [
    [b"1", b"a@b.io", b"x", b"c@d.io k"],
    [b"a@b.io", b"", b"e@f.io"],
    [b"", b"", b"a@b.io", b""],
    [b"caf\xc3\xa9 a@b.io", b"x"],
    [b"\xf0\x90\x80 a@b.io", b"y"],  # invalid UTF-8 replaced by as many bytes: lengths kept
    [b"\xff a@b.io", b"y"],  # replaced by more bytes: not the row's bytes
    [b"a@b.io", None, b"c@d.io"],  # NULL: not the row's bytes
    [b"a\tb@c.io", b"d@e.io"],  # a tab in a cell
])
def test_cells_found_from_the_rows_text_are_those_of_its_layout(values: list[bytes | None]) -> None:
    """The text rows' fast path finds the cells, and their places in the frame, that the walk over the frame finds."""
    from proxies.postgres.codec import render_row
    from proxies.postgres.rowmask import _text_cells
    from proxies.postgres.rowmask import layout as _layout

    m = masker({"type": "mask", "pattern_regex": "[a-z]@|\\t[a-z]|o\\t"})
    reader = pg.BackendReader()
    reader.feed(pg.encode_data_row(values))
    row = next(iter(reader))
    text = render_row(None, row, formats=(0,) * len(values)).encode("utf-8", "surrogateescape")
    spans = m.row_spans(text)
    at, sizes, ends = _layout(row)
    simple = None not in values and all(b"\t" not in v for v in values) and ends[-1] == len(text)
    for named in [(), (0,), (1,), (0, len(values) - 1), tuple(range(len(values)))]:  # and the cells masked by name
        found = _text_cells(row, text, spans, named)
        assert (found is not None) == simple
        if found is not None:
            assert found == [(i, at[i], sizes[i]) for i in sorted({*m.cells_spanned(ends, spans), *named})]
            assert found


_CELLS = [b"", b"x", b"jane.doe@example.com", b"4111111111111111", b"4111 1111 1111 1111 a@b.io", b"a@b.io c@d.org",
          b"card 4111111111111112", b"id 12345", b"o", b"ab", b"caf\xc3\xa9 e@f.io", b"\xf0\x90\x80 a@b.io",
          b"x@y", b"4111111111111111@example.com", b"a@b.io4111111111111111", b"@@", b"none"]
_RULES = [
    [{"type": "mask", "patterns": ["card_number", "email"]}],
    [{"type": "mask", "patterns": ["email"]}],
    [{"type": "mask", "patterns": ["email", "card_number"], "style": "last4"}],
    [{"type": "mask", "patterns": ["card_number"]}, {"type": "mask", "pattern_regex": "o\\t|\\tx|b\\.io", "style": "hash"}],
    [{"type": "mask", "pattern_regex": "[a-z]+@"}],
    [{"type": "mask", "pattern_regex": "@.*"}],
    [{"type": "mask", "patterns": ["email"]}, {"type": "mask", "columns": ["contact"], "style": "hash"}],
]


@pytest.mark.parametrize("rules", _RULES)
def test_the_text_rows_fused_path_masks_and_records_as_the_general_path(rules: list[dict]) -> None:
    """``mask_text_row`` (one pass, row spans reused when one finder alone can match a cell) gives the frame,
    the recorded text and the count of ``mask_row`` + ``render_masked``, or steps aside (``_FALLBACK``)."""
    import random

    from proxies.postgres.codec import render_row
    from proxies.postgres.rowmask import FALLBACK as _FALLBACK
    from proxies.postgres.rowmask import mask_row, mask_text_row, render_masked

    m = masker(*rules)
    chance = random.Random(13)
    fused = 0
    for _ in range(1500):
        values = [chance.choice(_CELLS) for _ in range(chance.randint(1, 5))]
        oids = tuple(chance.choice((25, 25, 25, 1043, 20, 0)) for _ in values)
        reader = pg.BackendReader()
        reader.feed(pg.encode_data_row(values))
        row = next(iter(reader))
        text = render_row(None, row, formats=(0,) * len(values))
        data = text.encode("utf-8", "surrogateescape")
        spans = m.row_spans(data)
        general = mask_row(m, row, (0,) * len(values), oids, (), spans, len(data), data)
        expected = None if general is None else (general[0], render_masked(text, row, general[1], (), oids),
                                                 general[2])
        if not spans:
            assert expected is None
            continue
        got = mask_text_row(m, row, text, data, spans, oids)
        if got is _FALLBACK:
            continue
        fused += 1
        assert got == expected, (values, oids)
    assert fused > 300


@pytest.mark.parametrize("style", ["fixed", "last4", "hash"])
def test_the_rows_masked_by_column_name_alone_as_the_general_path(style: str) -> None:
    """``mask_named_row`` (the columns masked whole found from the row's text, one pass, the recorded text
    patched) gives the frame, the recorded text and the count of ``mask_row`` + ``render_masked`` for a row
    the patterns found nothing in, or steps aside (``_FALLBACK``: NULLs, tabs, non-ASCII text, JSON)."""
    import random

    from proxies.postgres.codec import render_row
    from proxies.postgres.rowmask import FALLBACK as _FALLBACK
    from proxies.postgres.rowmask import mask_named_row, mask_row, render_masked

    m = masker({"type": "mask", "patterns": ["email"]}, {"type": "mask", "columns": ["c"], "style": style})
    chance = random.Random(7)
    cells = [b"", b"x", b"id 12345", b"Lyon", b"renewal due", b"0.8125"] * 4 + [b"caf\xc3\xa9", b"\xff", b"a\tb", None]
    named = 0
    # first a NULL before the masked cell, 4 two-byte characters after it: the text as long as the frame says,
    # its places not the frame's (the text is not ASCII)
    for attempt in range(3001):
        if attempt:
            count = chance.randint(1, 12)
            values = [chance.choice(cells) for _ in range(count)]
            oids = tuple(chance.choice((25, 25, 25, 1043, 20, 1700, 0) * 3 + (114, 3802)) for _ in range(count))
            whole = tuple((i, style) for i in sorted(chance.sample(range(count + 2), chance.randint(1, 3))))
        else:
            values, count, oids, whole = [None, b"x", b"\xc3\xa9" * 4], 3, (25, 25, 25), ((1, style),)
        reader = pg.BackendReader()
        reader.feed(pg.encode_data_row(values))
        row = next(iter(reader))
        text = render_row(None, row, formats=(0,) * count)
        data = text.encode("utf-8", "surrogateescape")
        assert not m.row_spans(data)
        general = mask_row(m, row, (0,) * count, oids, whole, [], len(data), data)
        expected = None if general is None else (general[0], render_masked(text, row, general[1], (), oids),
                                                 general[2])
        got = mask_named_row(m, row, text, whole, oids)
        if got is _FALLBACK:
            continue
        named += 1
        assert got == expected, (values, oids, whole)
    assert named > 500
