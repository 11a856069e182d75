"""Unit tests of the masking paths the wire leaves besides text rows: binary containers and types read through the
catalog, values the masker cannot read (withheld), names and settings the target sends, the pending queue out of
step, and values too long to mask on the loop (issue 29)."""

from __future__ import annotations

import struct
from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from proxies.postgres import codec as pg
from proxies.postgres import values
from proxies.postgres.relay import UNTIL_READY, ClientSide, Pending, ServerSide
from tests.test_masking import answer, field, masker, policy_for, relay, rows_of

EMAIL = b"jane.doe@example.com"
CARD = 4111111111111111
PATTERNS = {"type": "mask", "patterns": ["card_number", "email"]}
BINARY = 1

# the database's own types, as catalog.TYPES_QUERY gives them: (OID, typtype, base, range subtype, range, send)
DOMAIN, ENUM, COMPOSITE, TEXTRANGE, TEXTMULTI, DOMAIN_ARRAY, OPAQUE, CITEXT = range(16400, 16408)
CATALOG = values.TypeShapes.from_catalog([
    (DOMAIN, "d", 25, 0, 0, None), (ENUM, "e", 0, 0, 0, "enum_send"), (COMPOSITE, "c", 0, 0, 0, "record_send"),
    (TEXTRANGE, "r", 0, 25, 0, "range_send"), (TEXTMULTI, "m", 0, 0, TEXTRANGE, "multirange_send"),
    (DOMAIN_ARRAY, "b", 0, 0, 0, "array_send"), (OPAQUE, "b", 0, 0, 0, "int4send"), (CITEXT, "b", 0, 0, 0, "textsend"),
])


# -- binary values, encoded here independently of proxies/postgres/values.py

def value(raw: bytes | None) -> bytes:
    return b"\xff\xff\xff\xff" if raw is None else struct.pack("!i", len(raw)) + raw


def array(elem: int, items: list[bytes | None], dims: list[tuple[int, int]] | None = None) -> bytes:
    dims = dims if dims is not None else ([(len(items), 1)] if items else [])
    head = struct.pack("!iiI", len(dims), int(None in items), elem) + b"".join(struct.pack("!ii", *d) for d in dims)
    return head + b"".join(value(item) for item in items)


def record(*fields: tuple[int, bytes | None]) -> bytes:
    return struct.pack("!i", len(fields)) + b"".join(struct.pack("!I", oid) + value(raw) for oid, raw in fields)


def range_(lower: bytes | None, upper: bytes | None, flags: int = 0x02) -> bytes:
    if lower is None:  # an infinite bound is never inclusive
        flags = flags & ~0x02 | 0x08
    if upper is None:
        flags |= 0x10
    return bytes([flags]) + b"".join(value(bound) for bound in (lower, upper) if bound is not None)


def int8(n: int) -> bytes:
    return struct.pack("!q", n)


def int4(n: int) -> bytes:
    return struct.pack("!i", n)


def test_containers_render_as_the_server_writes_them() -> None:
    assert values.render_binary(1009, array(25, [b"a b", None, b"", b"x"])) == '{"a b",NULL,"",x}'
    assert values.render_binary(1007, array(23, [int4(1), int4(2), int4(3), int4(4)], [(2, 1), (2, 1)])) == \
        "{{1,2},{3,4}}"
    assert values.render_binary(1007, array(23, [int4(5)], [(1, 0)])) == "[0:0]={5}"
    assert values.render_binary(2249, record((25, b"a,b"), (23, int4(3)), (25, None))) == '("a,b",3,)'
    assert values.render_binary(3926, range_(int8(1), int8(5))) == "[1,5)"
    assert values.render_binary(3926, range_(None, int8(5))) == "(,5)"
    assert values.render_binary(4536, struct.pack("!i", 1) + value(range_(int8(1), int8(5)))) == "{[1,5)}"
    assert values.render_binary(COMPOSITE, record((DOMAIN, EMAIL)), CATALOG) == f"({EMAIL.decode()})"
    assert values.render_binary(COMPOSITE, record((DOMAIN, EMAIL))) == "\\x" + record((DOMAIN, EMAIL)).hex()  # unknown


def test_arrays_records_and_composites_are_masked_element_by_element() -> None:
    m = masker(PATTERNS)
    masked = values.mask_binary(m, CATALOG, 1009, array(25, [EMAIL, b"x", None]))
    assert masked == (array(25, [b"****", b"x", None]), 1)
    masked = values.mask_binary(m, CATALOG, 1016, array(20, [int8(CARD), int8(7)]))
    assert masked == (array(20, [None, int8(7)]), 1)  # an int8 cannot hold the mask: NULL, and the null flag set
    nested = record((DOMAIN, EMAIL), (20, int8(CARD)), (1009, array(25, [b"a", b"mail " + EMAIL])))
    masked = values.mask_binary(m, CATALOG, COMPOSITE, nested)
    assert masked == (record((DOMAIN, b"****"), (20, None), (1009, array(25, [b"a", b"mail ****"]))), 3)
    assert values.mask_binary(m, CATALOG, 1009, array(25, [b"plain", b"text"])) is None
    assert values.mask_binary(m, CATALOG, DOMAIN_ARRAY, array(DOMAIN, [EMAIL])) == (array(DOMAIN, [b"****"]), 1)
    assert values.mask_binary(m, CATALOG, ENUM, EMAIL) == (b"****", 1)
    assert values.mask_binary(m, CATALOG, CITEXT, EMAIL) == (b"****", 1)


def test_ranges_and_multiranges_with_a_masked_bound_become_null() -> None:
    m = masker(PATTERNS)
    assert values.mask_binary(m, CATALOG, 3926, range_(int8(CARD), int8(CARD + 1))) == (None, 1)
    assert values.mask_binary(m, CATALOG, TEXTRANGE, range_(b"a", EMAIL)) == (None, 1)
    assert values.mask_binary(m, CATALOG, TEXTRANGE, range_(b"a", b"b")) is None
    multi = struct.pack("!i", 2) + value(range_(b"a", b"b")) + value(range_(b"c", EMAIL))
    assert values.mask_binary(m, CATALOG, TEXTMULTI, multi) == (None, 1)
    assert values.mask_binary(m, CATALOG, 3904, b"\x01") is None  # empty


def test_a_value_masked_whole_keeps_its_text_leaves_as_the_style_and_nulls_the_rest() -> None:
    m = masker({"type": "mask", "columns": ["c"], "style": "last4"})
    masked = values.mask_binary(m, CATALOG, COMPOSITE, record((DOMAIN, EMAIL), (20, int8(CARD))), "last4")
    assert masked == (record((DOMAIN, b"****************.com"), (20, None)), 2)
    assert values.mask_binary(m, CATALOG, 3926, range_(int8(1), int8(2)), "last4") == (None, 1)


def test_what_cannot_be_read_is_undecodable() -> None:
    m = masker(PATTERNS)
    for oid, raw, shapes in [(OPAQUE, int4(7), CATALOG), (COMPOSITE, record((25, EMAIL)), values.BUILTIN),
                             (1009, array(25, [EMAIL])[:-3], CATALOG), (1009, array(OPAQUE, [int4(1)]), CATALOG),
                             (2249, record((25, EMAIL)) + b"x", CATALOG), (3926, b"\x02\x00", CATALOG)]:
        try:
            values.mask_binary(m, shapes, oid, raw)
        except values.Undecodable:
            continue
        raise AssertionError(f"type {oid} was read: {raw!r}")


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(st.none(), st.text(max_size=12), st.sampled_from(["a@b.io", "x 4111111111111111 y"])),
                max_size=8))
def test_a_masked_text_array_is_each_element_masked(items: list[str | None]) -> None:
    m = masker(PATTERNS)
    raw = [None if item is None else item.encode("utf-8", "surrogateescape") for item in items]
    masked = values.mask_binary(m, CATALOG, 1009, array(25, raw))
    expected = [None if item is None else (m.mask(item) or (item, 0))[0] for item in raw]
    if masked is None:
        assert expected == raw
    else:
        assert masked[0] == array(25, expected) and masked[1] == sum(m.mask(i)[1] for i in raw if i and m.mask(i))


# -- through the relay

def test_binary_container_columns_are_masked_in_rows_and_recorded_as_text() -> None:
    policy, recorder = policy_for(PATTERNS)
    server = ServerSide(policy, deque(), {})
    server.set_types(CATALOG)
    out = answer(server,
                 pg.encode_row_description([field("mails", 1009, BINARY), field("c", COMPOSITE, BINARY),
                                            field("n", 23, BINARY)]),
                 pg.encode_data_row([array(25, [EMAIL, b"x"]), record((DOMAIN, EMAIL), (20, int8(1))), int4(5)]),
                 pg.encode_command_complete("SELECT 1"), pg.encode_ready_for_query())
    assert rows_of(out) == [[array(25, [b"****", b"x"]), record((DOMAIN, b"****"), (20, int8(1))), int4(5)]]
    recorded = "".join(text for kind, text in recorder.events if kind == "o")
    assert "{****,x}\t(****,1)\t5" in recorded and "jane" not in recorded


def test_a_binary_value_of_a_type_not_known_is_withheld_with_a_notice() -> None:
    policy, recorder = policy_for(PATTERNS)
    server = ServerSide(policy, deque(), {})
    server.set_types(CATALOG)
    out = answer(server, pg.encode_row_description([field("o", OPAQUE, BINARY), field("u", 16999, BINARY),
                                                    field("t", 25, BINARY)]),
                 pg.encode_data_row([int4(7), EMAIL, b"fine"]), pg.encode_data_row([int4(8), EMAIL, b"fine"]),
                 pg.encode_command_complete("SELECT 2"), pg.encode_ready_for_query())
    assert rows_of(out) == [[None, None, b"fine"]] * 2
    notices = [m for m in out if isinstance(m, pg.NoticeResponse)]
    assert len(notices) == 1 and "withheld" in notices[0].message and "16999" in notices[0].message
    assert notices[0].severity == "WARNING"
    assert any(kind == "e" and "withheld" in text for kind, text in recorder.events)
    assert EMAIL.decode() not in repr(recorder.events)
    # without a mask rule nothing is withheld: the value passes as the target sent it
    plain, _ = policy_for()
    out = answer(ServerSide(plain, deque(), {}), pg.encode_row_description([field("u", 16999, BINARY)]),
                 pg.encode_data_row([EMAIL]), pg.encode_command_complete("SELECT 1"))
    assert rows_of(out) == [[EMAIL]]


def test_column_names_settings_notification_channels_and_every_error_field_are_masked() -> None:
    policy, recorder = policy_for(PATTERNS)
    server = ServerSide(policy, deque(), {})
    error = pg.encode_error_response("ERROR", "23502", "null value in column violates not-null constraint", {
        "c": EMAIL.decode(), "t": "t " + EMAIL.decode(), "s": EMAIL.decode(), "n": EMAIL.decode(),
        "d": EMAIL.decode(), "F": "execMain.c", "L": "2000", "R": "ExecConstraints"})
    out = answer(server,
                 pg.encode_parameter_status("application_name", EMAIL.decode()),
                 pg.encode_notification_response(7, EMAIL.decode(), "payload"),
                 pg.encode_row_description([field(EMAIL.decode(), 25), field("id", 23)]),
                 pg.encode_data_row([b"a", b"1"]), pg.encode_command_complete("SELECT 1"), error,
                 pg.encode_ready_for_query())
    status, notification, description, _, _, err, _ = out
    assert (status.name, status.value) == ("application_name", "****")
    assert (notification.channel, notification.payload) == ("****", "payload")
    assert description.names == ["****", "id"] and description.fields[1].type_oid == 23
    fields = err.fields
    assert [fields[c] for c in "ctsnd"] == ["****", "t ****", "****", "****", "****"]
    assert (fields["C"], fields["F"], fields["L"], fields["R"]) == ("23502", "execMain.c", "2000", "ExecConstraints")
    recorded = "\n".join(text for _, text in recorder.events)
    assert "jane" not in recorded and "****\tid\n" in recorded  # the recorded header too


def test_a_column_masked_by_name_keeps_its_mask_under_the_identity_it_was_seen_with() -> None:
    """A rule's column from a table the catalog did not know (made since) is learned by its identity."""
    policy, _ = policy_for({"type": "mask", "columns": ["ssn"]})
    server = ServerSide(policy, deque(), {})
    wanted: list[int] = []
    server.catalog_wanted = lambda: wanted.append(1)
    server.set_sources({}, ["ssn"])
    seen = pg.FieldDescription("ssn", table_oid=17001, column=2, type_oid=25)
    renamed = pg.FieldDescription("s", table_oid=17001, column=2, type_oid=25)
    out = answer(server, pg.encode_row_description([seen]), pg.encode_data_row([b"078-05-1120"]),
                 pg.encode_command_complete("SELECT 1"), pg.encode_row_description([renamed]),
                 pg.encode_data_row([b"078-05-1120"]), pg.encode_command_complete("SELECT 1"))
    assert rows_of(out) == [[b"****"], [b"****"]]
    assert server.learned == {(17001, 2): "ssn"} and wanted


def test_a_column_whose_type_holds_a_masked_column_is_masked_whole() -> None:
    """``select p from people p``: the column is the table's row type (no name, no source), its values hold ssn.
    Masked whole as a column masked by name (``last4`` made ``fixed``: the end of a value is another field's);
    a type made since the catalog was read is too, until the catalog read again says it holds nothing."""
    row_type, rows_type, made = 16500, 16501, 16502
    shapes = values.TypeShapes.from_catalog([(row_type, "c", 0, 0, 0, "record_send"),
                                             (rows_type, "b", 0, 0, 0, "array_send"),
                                             (OPAQUE, "b", 0, 0, 0, "int4send")])  # listed, no shape: not new
    policy, recorder = policy_for({"type": "mask", "columns": ["ssn"], "style": "last4"})
    server = ServerSide(policy, deque([Pending(UNTIL_READY)]), {})  # a query naming no masked column: "o" computed
    wanted: list[int] = []
    server.catalog_wanted = lambda: wanted.append(1)
    server.set_types(shapes)
    ssn = (17001, 2)
    server.set_sources({ssn: "ssn"}, ["ssn"], {row_type: (ssn,), rows_type: (ssn,)})
    people = record((23, int4(1)), (25, b"078-05-1120"))
    description = pg.encode_row_description([field("p", row_type), field("ps", rows_type, BINARY),
                                             field("o", OPAQUE), field("m", made), field("r", 2249, BINARY)])
    cells = [b"(1,078-05-1120)", array(row_type, [people]), b"7", b"(078-05-1120)", record((25, b"plain"))]
    out = answer(server, description, pg.encode_data_row(cells), pg.encode_command_complete("SELECT 1"))
    masked_people = record((23, None), (25, b"****"))
    assert rows_of(out) == [[b"****", array(row_type, [masked_people]), b"7", b"****", cells[4]]]
    assert wanted  # the type made since: the catalog is read again
    assert "078-05-1120" not in repr(recorder.events)
    server.set_types(values.TypeShapes.from_catalog([(row_type, "c", 0, 0, 0, "record_send"),
                                                     (rows_type, "b", 0, 0, 0, "array_send"),
                                                     (made, "c", 0, 0, 0, "record_send")]))
    server.set_sources({ssn: "ssn"}, ["ssn"], {row_type: (ssn,), rows_type: (ssn,)})  # ``made`` holds no ssn
    out = answer(server, description, pg.encode_data_row(cells), pg.encode_command_complete("SELECT 1"))
    assert rows_of(out)[0][3] == b"(078-05-1120)"
    # the catalog could not be read: every value masked whole, a text value that is no one string in ``fixed``
    server.set_sources(None, ["ssn"])
    out = answer(server, description, pg.encode_data_row(cells), pg.encode_command_complete("SELECT 1"))
    assert rows_of(out)[0][:2] == [b"****", array(row_type, [record((23, None), (25, b"*******1120"))])]


def test_a_query_the_target_skips_after_an_extended_error_masks_everything_until_the_queue_is_in_step() -> None:
    """Bind to a statement that does not exist, a simple Query, Sync: the target answers the error and one
    ReadyForQuery (it skips the Query), so the queue holds one entry too many. Until it is in step again,
    every value is masked whole; a statement described before then keeps its own columns' masks."""
    client, server, recorder = _sides({"type": "mask", "columns": ["ssn"]})
    send(client, pg.encode_parse("s1", "select ssn from t"), pg.encode_describe("S", "s1"), pg.encode_sync(),
         pg.encode_parse("s2", "select id from t"), pg.encode_describe("S", "s2"), pg.encode_sync())
    answer(server, pg.encode_parse_complete(), pg.encode_parameter_description([]),
           pg.encode_row_description([field("ssn", 25)]), pg.encode_ready_for_query(),
           pg.encode_parse_complete(), pg.encode_parameter_description([]),
           pg.encode_row_description([field("id", 25)]), pg.encode_ready_for_query())
    send(client, pg.encode_bind("", "nope"), pg.encode_query("select 1"), pg.encode_sync())
    answer(server, pg.encode_error_response("ERROR", "26000", 'prepared statement "nope" does not exist'),
           pg.encode_ready_for_query())
    assert server.unsure
    send(client, pg.encode_bind("", "s2"), pg.encode_execute(""), pg.encode_sync())
    out = answer(server, pg.encode_bind_complete(), pg.encode_row_description([field("id", 25)]),
                 pg.encode_data_row([b"078-05-1120"]), pg.encode_command_complete("SELECT 1"),
                 pg.encode_ready_for_query())
    assert rows_of(out) == [[b"****"]]  # out of step: masked whole, and the client told why
    assert any(isinstance(m, pg.NoticeResponse) and "out of step" in m.message for m in out)
    assert not server.unsure and not server.pending  # the stale Sync went, the queue emptied
    send(client, pg.encode_bind("", "s1"), pg.encode_execute(""), pg.encode_sync(),
         pg.encode_bind("", "s2"), pg.encode_execute(""), pg.encode_sync())
    out = answer(server, pg.encode_bind_complete(), pg.encode_row_description([field("ssn", 25)]),
                 pg.encode_data_row([b"078-05-1120"]), pg.encode_command_complete("SELECT 1"),
                 pg.encode_ready_for_query(), pg.encode_bind_complete(), pg.encode_row_description([field("id", 25)]),
                 pg.encode_data_row([b"12"]), pg.encode_command_complete("SELECT 1"), pg.encode_ready_for_query())
    assert rows_of(out) == [[b"****"], [b"12"]]  # in step again: each statement by its own description
    assert "078-05-1120" not in repr(recorder.events)


def test_a_value_longer_than_the_limit_is_withheld_before_it_is_read() -> None:
    policy, recorder = policy_for(PATTERNS)
    server = ServerSide(policy, deque(), {})
    server.row_limit = 64
    big = b"x" * 100 + EMAIL
    out = answer(server, pg.encode_row_description([field("a", 25), field("b", 25)]),
                 pg.encode_data_row([big, b"mail " + EMAIL]), pg.encode_data_row([b"small", big]),
                 pg.encode_command_complete("SELECT 2"), pg.encode_ready_for_query(),
                 pg.encode_copy_out_response(0, [0]), pg.encode_copy_data(big + b"\n"), pg.encode_copy_done(),
                 pg.encode_command_complete("COPY 1"), pg.encode_ready_for_query())
    assert rows_of(out) == [[None, b"mail ****"], [b"small", None]]
    assert sum(isinstance(m, pg.NoticeResponse) and "mask_row_bytes" in m.message for m in out) == 1
    assert not any(isinstance(m, pg.CopyData) for m in out)
    assert any(isinstance(m, pg.ErrorResponse) and "mask_row_bytes" in m.message for m in out)
    assert "jane" not in repr(recorder.events)


_sides = relay


def send(client: ClientSide, *frames: bytes) -> None:
    reader = pg.FrontendReader(expect_startup=False)
    reader.feed(b"".join(frames))
    for message in reader:
        client.on_message(message)


def test_too_many_values_to_mask_on_the_loop_are_withheld() -> None:
    """Where the patterns find more values than the relay masks on the loop (a row, a notice, an array), it
    withholds them instead of holding every other session of its worker."""
    from proxies.postgres.rowmask import MAX_ROW_MATCHES

    policy, recorder = policy_for(PATTERNS)
    server = ServerSide(policy, deque(), {})
    many = b" ".join([b"a@b.io"] * (MAX_ROW_MATCHES + 1))
    out = answer(server, pg.encode_row_description([field("a", 25), field("b", 23)]),
                 pg.encode_data_row([many, b"1"]), pg.encode_data_row([b"a@b.io", b"2"]),
                 pg.encode_command_complete("SELECT 2"),
                 pg.encode_notice_response("NOTICE", "00000", many.decode()), pg.encode_ready_for_query())
    assert rows_of(out) == [[None, None], [b"****", b"2"]]
    notices = [m.message for m in out if isinstance(m, pg.NoticeResponse)]
    assert "withheld" in notices[0] and str(MAX_ROW_MATCHES) in notices[0]
    assert notices[1] == f"[{len(many)} bytes withheld by gatewayd: too long to mask]"
    assert "a@b.io" not in repr(recorder.events)
    m = masker(PATTERNS)
    try:
        values.mask_binary(m, CATALOG, 1007, array(23, [int4(1)] * (values.MAX_ITEMS + 1)))
    except values.Undecodable as exc:
        assert "too many" in str(exc)
    else:
        raise AssertionError("an array too long to mask was read")


def test_an_execute_error_before_a_simple_query_in_the_same_batch_makes_the_relay_unsure_too() -> None:
    client, server, _ = _sides({"type": "mask", "columns": ["ssn"]})
    send(client, pg.encode_parse("s2", "select id from t"), pg.encode_describe("S", "s2"), pg.encode_sync())
    answer(server, pg.encode_parse_complete(), pg.encode_parameter_description([]),
           pg.encode_row_description([field("id", 25)]), pg.encode_ready_for_query())
    send(client, pg.encode_bind("", "s2"), pg.encode_execute(""), pg.encode_query("select 1"), pg.encode_sync())
    answer(server, pg.encode_bind_complete(), pg.encode_row_description([field("id", 25)]),
           pg.encode_error_response("ERROR", "22012", "division by zero"), pg.encode_ready_for_query())
    assert server.unsure
    send(client, pg.encode_bind("", "s2"), pg.encode_execute(""), pg.encode_sync())
    out = answer(server, pg.encode_bind_complete(), pg.encode_row_description([field("id", 25)]),
                 pg.encode_data_row([b"078-05-1120"]), pg.encode_command_complete("SELECT 1"),
                 pg.encode_ready_for_query())
    assert rows_of(out) == [[b"****"]] and not server.unsure and not server.pending


def test_an_escaped_value_inside_a_container_is_masked_though_the_rows_text_hides_it() -> None:
    """A container whose values stand as they are in the row's text is skipped when that text matched nowhere;
    one whose text escapes a value (``"a\\\\"b"``) is walked, so a pattern over the quote still finds it."""
    policy, _ = policy_for({"type": "mask", "pattern_regex": 'k"9'})
    server = ServerSide(policy, deque(), {})
    out = answer(server, pg.encode_row_description([field("a", 1009, BINARY), field("b", 1009, BINARY)]),
                 pg.encode_data_row([array(25, [b'k"9', b"x"]), array(25, [b"plain"])]),
                 pg.encode_command_complete("SELECT 1"), pg.encode_ready_for_query())
    assert rows_of(out) == [[array(25, [b"****", b"x"]), array(25, [b"plain"])]]
