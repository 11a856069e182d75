"""Unit and property tests for the pure PostgreSQL v3 codec (proxies/postgres/codec.py)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxies.postgres import codec as pg
from proxies.postgres.codec import (
    BackendReader,
    FieldDescription,
    FrontendReader,
    ProtocolError,
    ScramError,
    ScramSha256Client,
)

FUZZ = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def drain(reader: pg._FrameBuffer, limit: int = 100_000) -> list[pg.Message]:
    """All complete messages; fails instead of looping forever."""
    out = []
    for _ in range(limit):
        message = reader.next_message()
        if message is None:
            return out
        out.append(message)
    raise AssertionError("reader kept returning messages")


def frames(messages: list[pg.Message]) -> list[tuple[type, bytes]]:
    return [(type(m), bytes(m)) for m in messages]


# --------------------------------------------------------------------------- hand-built bytes (spec check)


def test_writers_match_hand_built_frames() -> None:
    assert pg.encode_query("select 1") == b"Q\x00\x00\x00\x0dselect 1\x00"
    assert pg.encode_sync() == b"S\x00\x00\x00\x04"
    assert pg.encode_terminate() == b"X\x00\x00\x00\x04"
    assert pg.encode_ssl_request() == b"\x00\x00\x00\x08\x04\xd2\x16\x2f"
    assert pg.encode_gssenc_request() == b"\x00\x00\x00\x08\x04\xd2\x16\x30"
    assert pg.encode_cancel_request(42, b"\x01\x02\x03\x04") == b"\x00\x00\x00\x10\x04\xd2\x16\x2e\x00\x00\x00\x2a\x01\x02\x03\x04"
    assert pg.encode_authentication_ok() == b"R\x00\x00\x00\x08\x00\x00\x00\x00"
    assert pg.encode_authentication_cleartext_password() == b"R\x00\x00\x00\x08\x00\x00\x00\x03"
    assert pg.encode_ready_for_query("I") == b"Z\x00\x00\x00\x05I"
    assert pg.encode_startup_message({"user": "bob"}) == (
        b"\x00\x00\x00\x12\x00\x03\x00\x00user\x00bob\x00\x00"
    )
    assert pg.encode_data_row([b"1", None]) == b"D\x00\x00\x00\x0f\x00\x02\x00\x00\x00\x011\xff\xff\xff\xff"
    assert pg.encode_command_complete("SELECT 1") == b"C\x00\x00\x00\x0dSELECT 1\x00"
    assert pg.encode_row_description(["a"]) == (
        b"T\x00\x00\x00\x1a\x00\x01a\x00" + struct.pack("!IhIhih", 0, 0, 25, -1, -1, 0)
    )


def test_hand_built_backend_frames_decode() -> None:
    auth_md5 = b"R\x00\x00\x00\x0c\x00\x00\x00\x05\xaa\xbb\xcc\xdd"
    notification = b"A\x00\x00\x00\x15\x00\x00\x00\x07chan\x00payload\x00"
    error = b"E\x00\x00\x00\x1bSERROR\x00C42601\x00Msyntax\x00\x00"
    reader = BackendReader()
    reader.feed(auth_md5 + notification + error)
    a, n, e = drain(reader)
    assert isinstance(a, pg.Authentication) and a.kind == "md5" and a.salt == b"\xaa\xbb\xcc\xdd"
    assert isinstance(n, pg.NotificationResponse)
    assert (n.process_id, n.channel, n.payload) == (7, "chan", "payload")
    assert isinstance(e, pg.ErrorResponse)
    assert (e.severity, e.sqlstate, e.message) == ("ERROR", "42601", "syntax")


# --------------------------------------------------------------------------- round trips, frontend

FRONTEND_CASES = [
    (pg.encode_query("select 1; select 'é'"), pg.Query, {"sql": "select 1; select 'é'"}),
    (pg.encode_parse("s1", "select $1::int", [23]), pg.Parse, {"name": "s1", "sql": "select $1::int", "param_types": [23]}),
    (pg.encode_parse("", "select 1"), pg.Parse, {"name": "", "sql": "select 1", "param_types": []}),
    (
        pg.encode_bind("p1", "s1", [b"\x00\x00\x00\x01", None, "txt"], [1, 1, 0], [1]),
        pg.Bind,
        {
            "portal": "p1", "statement": "s1", "param_formats": [1, 1, 0],
            "params": [b"\x00\x00\x00\x01", None, b"txt"], "result_formats": [1],
        },
    ),
    (pg.encode_bind("", "", []), pg.Bind, {"portal": "", "statement": "", "param_formats": [], "params": [], "result_formats": []}),
    (pg.encode_describe("S", "s1"), pg.Describe, {"kind": "S", "name": "s1"}),
    (pg.encode_describe("P"), pg.Describe, {"kind": "P", "name": ""}),
    (pg.encode_execute("p1", 100), pg.Execute, {"portal": "p1", "max_rows": 100}),
    (pg.encode_close("S", "s1"), pg.Close, {"kind": "S", "name": "s1"}),
    (pg.encode_sync(), pg.Sync, {}),
    (pg.encode_flush(), pg.Flush, {}),
    (pg.encode_terminate(), pg.Terminate, {}),
    (pg.encode_copy_data(b"1\tx\n"), pg.CopyData, {"length": 4}),
    (pg.encode_copy_done(), pg.CopyDone, {}),
    (pg.encode_copy_fail("boom"), pg.CopyFail, {"message": "boom"}),
    (
        pg.encode_function_call(952, [b"\x00\x01", None], [1], 1),
        pg.FunctionCall,
        {"function_oid": 952, "arg_formats": [1], "args": [b"\x00\x01", None], "result_format": 1},
    ),
]


@pytest.mark.parametrize(("frame", "cls", "fields"), FRONTEND_CASES, ids=lambda v: getattr(v, "__name__", None))
def test_frontend_round_trip(frame: bytes, cls: type, fields: dict) -> None:
    message = pg.decode_frontend(frame)
    assert type(message) is cls
    assert message.type_code == frame[:1]
    assert bytes(message.frame) == frame
    assert message.to_dict() == fields
    assert message == pg.decode_frontend(frame)


def test_bind_param_formats() -> None:
    bind = pg.decode_frontend(pg.encode_bind("", "", [b"a", b"b"], [1]))
    assert bind.param_is_binary(0) and bind.param_is_binary(1)
    bind = pg.decode_frontend(pg.encode_bind("", "", [b"a", b"b"], [0, 1]))
    assert not bind.param_is_binary(0) and bind.param_is_binary(1)
    assert pg.resolve_formats([], 3) == [0, 0, 0]
    assert pg.resolve_formats([1], 2) == [1, 1]
    assert pg.resolve_formats([0, 1], 2) == [0, 1]


def test_copy_data_is_a_view() -> None:
    frame = pg.encode_copy_data(b"abc")
    message = pg.decode_frontend(frame)
    assert isinstance(message.data, memoryview) and bytes(message.data) == b"abc"


def test_password_and_sasl_messages() -> None:
    message = pg.decode_frontend(pg.encode_password("s3cret"))
    assert isinstance(message, pg.PasswordMessage)
    assert message.password == "s3cret"
    assert "s3cret" not in repr(message) and message.to_dict() == {"length": len(message)}
    initial = pg.decode_frontend(pg.encode_sasl_initial_response("SCRAM-SHA-256", b"n,,n=,r=abc"))
    assert initial.sasl_initial_response() == ("SCRAM-SHA-256", b"n,,n=,r=abc")
    assert pg.decode_frontend(pg.encode_sasl_initial_response("X", None)).sasl_initial_response() == ("X", None)
    assert pg.decode_frontend(pg.encode_sasl_response(b"c=biws,r=x,p=y")).data == b"c=biws,r=x,p=y"
    with pytest.raises(ProtocolError):
        _ = pg.decode_frontend(pg.encode_sasl_response(b"no nul here")).password


# --------------------------------------------------------------------------- round trips, backend

BACKEND_CASES = [
    (pg.encode_authentication_ok(), pg.Authentication, {"code": 0, "kind": "ok"}),
    (pg.encode_authentication_cleartext_password(), pg.Authentication, {"code": 3, "kind": "cleartext"}),
    (pg.encode_authentication_md5_password(b"salt"), pg.Authentication, {"code": 5, "kind": "md5", "salt": b"salt"}),
    (
        pg.encode_authentication_sasl(["SCRAM-SHA-256-PLUS", "SCRAM-SHA-256"]),
        pg.Authentication,
        {"code": 10, "kind": "sasl", "mechanisms": ["SCRAM-SHA-256-PLUS", "SCRAM-SHA-256"]},
    ),
    (pg.encode_authentication_sasl_continue(b"r=a,s=b,i=1"), pg.Authentication, {"code": 11, "kind": "sasl_continue", "data_length": 11}),
    (pg.encode_authentication_sasl_final(b"v=xyz"), pg.Authentication, {"code": 12, "kind": "sasl_final", "data_length": 5}),
    (pg.encode_parameter_status("client_encoding", "UTF8"), pg.ParameterStatus, {"name": "client_encoding", "value": "UTF8"}),
    (pg.encode_backend_key_data(1234, b"\x00\x00\x00\x05"), pg.BackendKeyData, {"process_id": 1234}),
    (pg.encode_ready_for_query("T"), pg.ReadyForQuery, {"status": "T"}),
    (
        pg.encode_row_description([FieldDescription("id", 16384, 1, 23, 4, -1, 1), "name"]),
        pg.RowDescription,
        {"fields": [FieldDescription("id", 16384, 1, 23, 4, -1, 1), FieldDescription("name")]},
    ),
    (pg.encode_data_row([b"1", None, "é", b""]), pg.DataRow, {"columns": [b"1", None, "é".encode(), b""]}),
    (pg.encode_data_row([]), pg.DataRow, {"columns": []}),
    (pg.encode_command_complete("INSERT 0 3"), pg.CommandComplete, {"tag": "INSERT 0 3"}),
    (
        pg.encode_error_response("FATAL", "28P01", "password authentication failed", {"D": "detail", "H": "hint"}),
        pg.ErrorResponse,
        {"fields": {"S": "FATAL", "V": "FATAL", "C": "28P01", "M": "password authentication failed", "D": "detail", "H": "hint"}},
    ),
    (
        pg.encode_notice_response("WARNING", "01000", "careful"),
        pg.NoticeResponse,
        {"fields": {"S": "WARNING", "V": "WARNING", "C": "01000", "M": "careful"}},
    ),
    (pg.encode_notification_response(99, "jobs", "42"), pg.NotificationResponse, {"process_id": 99, "channel": "jobs", "payload": "42"}),
    (pg.encode_copy_in_response(0, [0, 0]), pg.CopyInResponse, {"format": 0, "column_formats": [0, 0]}),
    (pg.encode_copy_out_response(1, [1]), pg.CopyOutResponse, {"format": 1, "column_formats": [1]}),
    (pg.encode_copy_both_response(0, []), pg.CopyBothResponse, {"format": 0, "column_formats": []}),
    (pg.encode_copy_data(b"row\n"), pg.CopyData, {"length": 4}),
    (pg.encode_copy_done(), pg.CopyDone, {}),
    (pg.encode_parse_complete(), pg.ParseComplete, {}),
    (pg.encode_bind_complete(), pg.BindComplete, {}),
    (pg.encode_close_complete(), pg.CloseComplete, {}),
    (pg.encode_no_data(), pg.NoData, {}),
    (pg.encode_portal_suspended(), pg.PortalSuspended, {}),
    (pg.encode_empty_query_response(), pg.EmptyQueryResponse, {}),
    (pg.encode_parameter_description([23, 25, 4294967295]), pg.ParameterDescription, {"param_types": [23, 25, 4294967295]}),
    (pg.encode_negotiate_protocol_version(0, ["_pq_.x"]), pg.NegotiateProtocolVersion, {"newest_minor": 0, "unrecognized_options": ["_pq_.x"]}),
    (pg.encode_function_call_response(b"\x01"), pg.FunctionCallResponse, {"result": b"\x01"}),
    (pg.encode_function_call_response(None), pg.FunctionCallResponse, {"result": None}),
]


@pytest.mark.parametrize(("frame", "cls", "fields"), BACKEND_CASES, ids=lambda v: getattr(v, "__name__", None))
def test_backend_round_trip(frame: bytes, cls: type, fields: dict) -> None:
    message = pg.decode_backend(frame)
    assert type(message) is cls
    assert bytes(message.frame) == frame
    assert message.to_dict() == fields


def test_backend_accessors() -> None:
    key = pg.decode_backend(pg.encode_backend_key_data(7, b"k" * 32))  # protocol 3.2 long key
    assert key.secret_key == b"k" * 32
    assert pg.decode_backend(pg.encode_backend_key_data(7, -5)).secret_key == (-5).to_bytes(4, "big", signed=True)
    tag = pg.decode_backend(pg.encode_command_complete("INSERT 0 3"))
    assert (tag.command, tag.row_count) == ("INSERT", 3)
    assert pg.decode_backend(pg.encode_command_complete("BEGIN")).row_count is None
    assert pg.decode_backend(pg.encode_command_complete("SELECT 12")).row_count == 12
    desc = pg.decode_backend(pg.encode_row_description([FieldDescription("a", format=1), "b"]))
    assert desc.names == ["a", "b"] and desc.formats == (1, 0) and desc.column_count == 2
    row = pg.decode_backend(pg.encode_data_row([b"x", None]))
    assert row.column_count == 2
    views = row.column_views()
    assert isinstance(views[0], memoryview) and bytes(views[0]) == b"x" and views[1] is None
    err = pg.decode_backend(pg.encode_error_response("ERROR", "42P01", "no table", {"D": "d", "H": "h"}))
    assert (err.detail, err.hint) == ("d", "h")
    ready = pg.decode_backend(pg.encode_ready_for_query("E"))
    assert ready.in_transaction
    with pytest.raises(ProtocolError):
        _ = pg.decode_backend(pg.encode_authentication_ok()).salt


def test_error_response_with_nul_in_text_stays_framed() -> None:
    frame = pg.encode_error_response("ERROR", "42000", "bad\0value")
    assert pg.decode_backend(frame).message == "bad\ufffdvalue"


def test_unknown_type_bytes_frame_generically() -> None:
    weird = pg.encode_message(b"Y", b"\x01\x02\x03")
    reader = BackendReader()
    reader.feed(weird + pg.encode_ready_for_query())
    first, second = drain(reader)
    assert isinstance(first, pg.UnknownMessage) and first.type_code == b"Y" and bytes(first.body) == b"\x01\x02\x03"
    assert isinstance(second, pg.ReadyForQuery)
    front = FrontendReader(expect_startup=False)
    front.feed(pg.encode_message(b"~", b"") + pg.encode_sync())
    assert [type(m) for m in drain(front)] == [pg.UnknownMessage, pg.Sync]


def test_malformed_bodies_frame_but_fail_on_decode() -> None:
    bad_row = pg.encode_message(b"D", b"\x00\x02\x00\x00\x00\x09ab")  # column claims 9 bytes
    reader = BackendReader()
    reader.feed(bad_row + pg.encode_ready_for_query())
    row, ready = drain(reader)  # framing is unaffected
    assert row.column_count == 2
    with pytest.raises(ProtocolError):
        _ = row.columns
    with pytest.raises(ProtocolError):
        pg.render_row(None, row)
    assert "malformed" in repr(row)
    assert ready.status == "I"
    for frame in [
        pg.encode_message(b"Z", b"Q"),  # unknown status
        pg.encode_message(b"Z", b"II"),  # trailing
        pg.encode_message(b"C", b"no terminator"),
        pg.encode_message(b"S", b"name\0"),
        pg.encode_message(b"1", b"x"),
        pg.encode_message(b"K", b"\0\0\0\1\0"),  # cancel key too short
        pg.encode_message(b"R", b"\0\0\0\x05ab"),  # md5 salt short
        pg.encode_message(b"T", b"\x00\x01a\x00"),
        pg.encode_message(b"v", b"\0\0\0\0\xff\xff\xff\xff"),
    ]:
        with pytest.raises(ProtocolError):
            pg.decode_backend(frame).validate()
    for frame in [
        pg.encode_message(b"D", b"X\0"),  # Describe of neither S nor P
        pg.encode_message(b"B", b"\0\0\x00\x02\x00\x01\x00\x01\x00\x00\x00\x00\x00\x00"),  # 2 formats, 1 param
        pg.encode_message(b"E", b"portal\0\0\0"),
        pg.encode_message(b"Q", b"select 1\0junk"),
        pg.encode_message(b"P", b"s\0q\0\x00\x02\0\0\0\x17"),
    ]:
        with pytest.raises(ProtocolError):
            pg.decode_frontend(frame).validate()


def test_a_nul_inside_a_query_or_a_command_tag_is_malformed_even_with_one_at_the_end() -> None:
    """The decoders' fast path takes a body whose last byte is its NUL only when no other NUL is in it: a string
    cut short by a NUL (``select 1`` then ``\\0junk\\0``) is a malformed message, as the cursor reads it, never
    the statement with the NUL inside (the rules would read one thing and the target another)."""
    for decode, body in [(pg.decode_frontend, b"Q" + b"select 1\0; drop table t\0"),
                         (pg.decode_backend, b"C" + b"SELECT 1\0x\0")]:
        message = decode(pg.encode_message(body[:1], body[1:]))
        with pytest.raises(ProtocolError):
            message.validate()
    assert pg.decode_frontend(pg.encode_query("select 1")).sql == "select 1"
    assert pg.decode_backend(pg.encode_command_complete("SELECT 1")).tag == "SELECT 1"


@pytest.mark.parametrize("size", [0, 1, 2, 126, 127, 128, 129, 130, 255, 256, 257, 400])
def test_names_and_statements_of_every_length_round_the_nul_search_read_whole(size: int) -> None:
    """The extended protocol's strings (a statement's text and name, a portal) end at their NUL however long they
    are: compiled, the first ``NUL_RUN`` (128) bytes of each are searched in C and the rest by ``bytes.find``, so
    the lengths about 128 and 256 are the edges. A NUL inside a statement's text, before or past those edges, is
    refused as malformed. The suite runs compiled and from source (tests/test_hotpath.py)."""
    text = ("select " + "x" * size)[:size] if size else ""
    name = ("s" * size)[:size]
    parse = pg.decode_frontend(pg.encode_parse(name, text, [23, 25]))
    assert (parse.name, parse.sql, parse.param_types) == (name, text, [23, 25])
    bind = pg.decode_frontend(pg.encode_bind(name, name, [b"1", None], [0], [0]))
    assert (bind.portal, bind.statement, bind.params) == (name, name, [b"1", None])
    assert pg.decode_frontend(pg.encode_execute(name, 7)).to_dict() == {"portal": name, "max_rows": 7}
    assert pg.decode_frontend(pg.encode_describe("S", name)).to_dict() == {"kind": "S", "name": name}
    for inner in sorted({0, size // 2, 127, 128, 129, size - 1}):
        if 0 <= inner < size:
            body = name.encode() + b"\0" + text.encode()[:inner] + b"\0" + text.encode()[inner + 1:] + b"\0" \
                + b"\0\0"
            with pytest.raises(ProtocolError):
                pg.decode_frontend(pg.encode_message(b"P", body)).validate()


# --------------------------------------------------------------------------- start-up phase


def test_startup_message() -> None:
    reader = FrontendReader()
    reader.feed(pg.encode_startup_message({"user": "alice", "database": "app", "application_name": "psql"}))
    (startup,) = drain(reader)
    assert isinstance(startup, pg.StartupMessage)
    assert (startup.major, startup.minor) == (3, 0)
    assert startup.parameters == {"user": "alice", "database": "app", "application_name": "psql"}
    assert (startup.user, startup.database) == ("alice", "app")
    assert reader.phase == "messages"
    reader.feed(pg.encode_password("pw") + pg.encode_query("select 1"))
    assert [type(m) for m in drain(reader)] == [pg.PasswordMessage, pg.Query]


def test_startup_protocol_3_2_and_default_database() -> None:
    startup = pg.decode_frontend(pg.encode_startup_message({"user": "bob"}, pg.PROTOCOL_3_2), startup=True)
    assert (startup.major, startup.minor, startup.database) == (3, 2, "bob")


def test_ssl_then_gssenc_then_startup() -> None:
    reader = FrontendReader()
    reader.feed(pg.encode_gssenc_request())
    assert isinstance(reader.next_message(), pg.GSSENCRequest)
    assert reader.next_message() is None and reader.phase == "startup" and reader.buffered == 0
    reader.feed(pg.encode_ssl_request())
    assert type(reader.next_message()) is pg.SSLRequest
    reader.feed(pg.encode_startup_message({"user": "u"}))
    assert isinstance(reader.next_message(), pg.StartupMessage)


def test_plaintext_after_ssl_request_is_visible() -> None:
    reader = FrontendReader()
    reader.feed(pg.encode_ssl_request() + pg.encode_startup_message({"user": "injected"}))
    assert isinstance(reader.next_message(), pg.SSLRequest)
    assert reader.buffered > 0  # the server must refuse: bytes arrived before the TLS handshake
    assert reader.take_buffered() == pg.encode_startup_message({"user": "injected"})
    assert reader.buffered == 0 and reader.next_message() is None


@pytest.mark.parametrize("key", [b"\x00\x00\x00\x01", bytes(range(32)), b"k" * 256])
def test_cancel_request(key: bytes) -> None:
    reader = FrontendReader()
    reader.feed(pg.encode_cancel_request(4242, key))
    (cancel,) = drain(reader)
    assert isinstance(cancel, pg.CancelRequest)
    assert (cancel.process_id, cancel.secret_key) == (4242, key)
    assert reader.phase == "done"
    reader.feed(b"x")
    with pytest.raises(ProtocolError):
        reader.next_message()


@pytest.mark.parametrize(
    ("data", "sqlstate"),
    [
        (struct.pack("!iI", 8, 2 << 16), "0A000"),  # protocol 2.0
        (struct.pack("!iI", 8, 4 << 16), "0A000"),
        (struct.pack("!iI", 8, (1234 << 16) | 9999), "08P01"),  # unknown special request
        (struct.pack("!iI", 12, pg.SSL_REQUEST_CODE) + b"\0" * 4, "08P01"),  # SSLRequest of the wrong size
        (struct.pack("!iI", 12, pg.CANCEL_REQUEST_CODE) + b"\0" * 4, "08P01"),  # no key
        (struct.pack("!iI", 12 + 257, pg.CANCEL_REQUEST_CODE), "08P01"),  # key too long
        (struct.pack("!i", 4), "08P01"),  # shorter than a startup packet
        (struct.pack("!i", -1), "08P01"),
        (struct.pack("!i", 10_001), "08P01"),  # oversized startup packet
        (b"\x16\x03\x01\x02\x00", "08P01"),  # direct TLS ClientHello
    ],
)
def test_startup_errors(data: bytes, sqlstate: str) -> None:
    reader = FrontendReader()
    reader.feed(data)
    with pytest.raises(ProtocolError) as info:
        reader.next_message()
    assert info.value.sqlstate == sqlstate
    with pytest.raises(ProtocolError):  # the reader stays dead
        reader.next_message()


def test_malformed_startup_parameters() -> None:
    body = struct.pack("!I", pg.PROTOCOL_3_0) + b"user\0bob\0"  # missing final terminator
    message = pg.decode_frontend(struct.pack("!i", len(body) + 4) + body, startup=True)
    with pytest.raises(ProtocolError):
        _ = message.parameters


def test_direct_tls_helper() -> None:
    assert pg.is_direct_tls_start(b"\x16\x03\x01")
    assert not pg.is_direct_tls_start(pg.encode_ssl_request())
    assert not pg.is_direct_tls_start(b"")


# --------------------------------------------------------------------------- typed framing errors


@pytest.mark.parametrize("length", [-1, 0, 3, -(2**31)])
def test_bad_typed_lengths(length: int) -> None:
    for reader in (BackendReader(), FrontendReader(expect_startup=False)):
        reader.feed(b"D" + struct.pack("!i", length) + b"\0" * 8)
        with pytest.raises(ProtocolError) as info:
            reader.next_message()
        assert info.value.sqlstate == "08P01"


def test_a_length_read_in_place_is_big_endian_and_signed() -> None:
    """Every byte of the length counts, high bits included (the hot path reads them one by one)."""
    frame = pg.encode_data_row([b"\x80" * 0x808080])
    assert all(byte >= 0x80 for byte in frame[2:5])
    reader = BackendReader(max_message_size=1 << 25)
    reader.feed(frame + pg.encode_data_row([b"x"]))
    row = reader.next_message()
    assert isinstance(row, pg.DataRow) and len(row) == len(frame) and row.columns == [b"\x80" * 0x808080]
    assert reader.next_message().columns == [b"x"] and reader.next_message() is None
    for reader in (BackendReader(), FrontendReader(expect_startup=False)):
        reader.feed(b"D\x80\x80\x80\x80" + b"\0" * 8)
        with pytest.raises(ProtocolError, match="invalid message length -2139062144 for message type b'D'"):
            reader.next_message()


def test_oversized_messages_are_rejected_before_buffering() -> None:
    reader = FrontendReader(expect_startup=False)
    reader.feed(b"Q" + struct.pack("!i", pg.DEFAULT_MAX_FRONTEND_MESSAGE + 1))
    with pytest.raises(ProtocolError):
        reader.next_message()
    small = BackendReader(max_message_size=100)
    small.feed(pg.encode_data_row([b"x" * 200]))
    with pytest.raises(ProtocolError):
        small.next_message()
    ok = BackendReader(max_message_size=100)
    ok.feed(pg.encode_data_row([b"x" * 50]))
    assert isinstance(ok.next_message(), pg.DataRow)


def test_eof_mid_message() -> None:
    frame = pg.encode_data_row([b"abc"])
    reader = BackendReader()
    reader.feed(frame + frame[:-2])
    assert isinstance(reader.next_message(), pg.DataRow)
    assert reader.next_message() is None
    reader.feed_eof()
    with pytest.raises(ProtocolError):
        reader.next_message()
    clean = BackendReader()
    clean.feed(frame)
    clean.feed_eof()
    assert isinstance(clean.next_message(), pg.DataRow) and clean.next_message() is None
    with pytest.raises(RuntimeError):
        clean.feed(b"x")


def test_read_ssl_response() -> None:
    reader = BackendReader()
    assert reader.read_ssl_response() is None
    reader.feed(b"N")
    assert reader.read_ssl_response() == b"N" and reader.buffered == 0
    reader.feed(b"S")
    assert reader.read_ssl_response() == b"S"
    reader.feed(pg.encode_error_response("FATAL", "08P01", "unsupported"))
    assert reader.read_ssl_response() == b"E"
    assert isinstance(reader.next_message(), pg.ErrorResponse)
    bad = BackendReader()
    bad.feed(b"X")
    with pytest.raises(ProtocolError):
        bad.read_ssl_response()


# --------------------------------------------------------------------------- streams, splits, pipelining


def backend_stream() -> bytes:
    return b"".join(
        [
            pg.encode_authentication_ok(),
            pg.encode_parameter_status("server_version", "16.2"),
            pg.encode_backend_key_data(1, b"\0\0\0\2"),
            pg.encode_ready_for_query("I"),
            pg.encode_row_description(["a", FieldDescription("b", type_oid=17, format=1)]),
            pg.encode_data_row([b"1", b"\xde\xad"]),
            pg.encode_data_row([None, b""]),
            pg.encode_command_complete("SELECT 2"),
            pg.encode_notice_response("NOTICE", "00000", "hello"),
            pg.encode_notification_response(5, "c", "p"),
            pg.encode_copy_out_response(0, [0]),
            pg.encode_copy_data(b"x\n"),
            pg.encode_copy_done(),
            pg.encode_command_complete("COPY 1"),
            pg.encode_error_response("ERROR", "22012", "division by zero"),
            pg.encode_ready_for_query("E"),
        ]
    )


def frontend_stream() -> bytes:
    return b"".join(
        [
            pg.encode_ssl_request(),
            pg.encode_startup_message({"user": "u", "database": "d"}),
            pg.encode_sasl_initial_response("SCRAM-SHA-256", b"n,,n=,r=abc"),
            pg.encode_query("begin; select 1; commit"),
            pg.encode_parse("s", "select $1", [0]),
            pg.encode_bind("", "s", [b"\0\0\0\1"], [1], [1]),
            pg.encode_describe("P"),
            pg.encode_execute("", 0),
            pg.encode_sync(),
            pg.encode_query("copy t from stdin"),
            pg.encode_copy_data(b"1\n"),
            pg.encode_copy_done(),
            pg.encode_terminate(),
        ]
    )


def parse_in_pieces(make_reader, data: bytes, cuts: list[int]) -> list[pg.Message]:
    reader = make_reader()
    out: list[pg.Message] = []
    previous = 0
    for cut in sorted(set(cuts)) + [len(data)]:
        reader.feed(data[previous:cut])
        previous = cut
        out += drain(reader)
    assert reader.buffered == 0
    return out


@pytest.mark.parametrize(
    ("make_reader", "stream"),
    [(BackendReader, backend_stream()), (FrontendReader, frontend_stream())],
    ids=["backend", "frontend"],
)
def test_split_at_every_byte_boundary(make_reader, stream: bytes) -> None:
    whole = frames(parse_in_pieces(make_reader, stream, []))
    assert b"".join(f for _, f in whole) == stream
    for cut in range(1, len(stream)):
        assert frames(parse_in_pieces(make_reader, stream, [cut])) == whole
    assert frames(parse_in_pieces(make_reader, stream, list(range(1, len(stream))))) == whole  # byte by byte


def test_pipelined_extended_protocol_in_one_feed() -> None:
    batch = b"".join(
        pg.encode_parse(f"s{i}", f"select {i}") + pg.encode_bind(f"p{i}", f"s{i}") + pg.encode_describe("P", f"p{i}")
        + pg.encode_execute(f"p{i}") + pg.encode_close("P", f"p{i}")
        for i in range(3)
    ) + pg.encode_flush() + pg.encode_sync()
    reader = FrontendReader(expect_startup=False)
    reader.feed(batch)
    messages = drain(reader)
    assert [type(m).__name__ for m in messages] == ["Parse", "Bind", "Describe", "Execute", "Close"] * 3 + ["Flush", "Sync"]
    assert [m.name for m in messages if isinstance(m, pg.Parse)] == ["s0", "s1", "s2"]


def test_zero_copy_on_backend_path() -> None:
    data = backend_stream() * 200  # one large bytes feed, as asyncio delivers it
    reader = BackendReader()
    reader.feed(data)
    messages = drain(reader)
    assert reader.bytes_copied == 0
    assert all(m.frame.obj is data for m in messages)
    assert not any(m._cache is not None for m in messages)  # nothing decoded while framing
    (joined,) = pg.coalesce_frames(messages)
    assert joined.obj is data and bytes(joined) == data


def test_coalesce_frames_keeps_gaps() -> None:
    data = pg.encode_data_row([b"a" * 2000]) * 3  # one feed above the coalescing threshold
    reader = BackendReader()
    reader.feed(data)
    rows = drain(reader)
    views = pg.coalesce_frames([rows[0], rows[2]])
    assert [bytes(v) for v in views] == [bytes(rows[0]), bytes(rows[2])]
    assert pg.coalesce_frames([]) == []


def test_large_datarow_stream_is_linear() -> None:
    rows = 100_000
    row = pg.encode_data_row([b"42", b"some text value", None])
    data = row * rows + pg.encode_command_complete(f"SELECT {rows}")
    chunk = 65536
    reader = BackendReader()
    seen = 0
    peak = 0
    for offset in range(0, len(data), chunk):
        reader.feed(data[offset : offset + chunk])
        peak = max(peak, reader.buffered)
        for message in reader:
            seen += 1
        assert reader.buffered < len(row)  # only a partial frame stays behind
        assert len(reader._chunks) <= 2
    assert seen == rows + 1
    assert peak <= chunk + len(row)
    chunks = -(-len(data) // chunk)
    assert reader.bytes_copied <= chunks * len(row)  # only frames straddling two chunks were copied


def test_small_complete_reads_are_not_copied() -> None:
    reader = BackendReader()
    for _ in range(3):
        reply = pg.encode_command_complete("BEGIN") + pg.encode_ready_for_query("T")
        reader.feed(reply)  # a small read holding whole messages, as in interactive use
        messages = drain(reader)
        assert [m.frame.obj for m in messages] == [reply, reply]
    assert reader.bytes_copied == 0


def test_trickled_bytes_are_coalesced() -> None:
    big = pg.encode_copy_data(b"z" * 200_000)
    reader = FrontendReader(expect_startup=False)
    for i in range(0, len(big), 7):
        reader.feed(big[i : i + 7])
        assert reader.next_message() is None or i + 7 >= len(big)
        assert len(reader._chunks) <= 2  # not one object per tiny feed
    assert reader.buffered == 0 or isinstance(reader.next_message(), pg.CopyData)
    assert reader.bytes_copied <= 3 * len(big)


# --------------------------------------------------------------------------- rendering


def test_render_row() -> None:
    desc = pg.decode_backend(
        pg.encode_row_description(["id", FieldDescription("blob", type_oid=17, format=1), "note", "bad"])
    )
    row = pg.decode_backend(pg.encode_data_row([b"1", b"\x00\xff", None, b"caf\xc3\xa9 \xff"]))
    assert pg.render_row(desc, row) == "1\t\\x00ff\tNULL\tcafé \ufffd"
    assert pg.render_row(None, row).startswith("1\t\x00\ufffd\t")
    assert pg.render_row(desc, row, formats=[1, 1, 1, 1]) == "\\x31\t\\x00ff\tNULL\t\\x636166c3a920ff"
    assert pg.render_row(desc.fields, row, max_column_bytes=2, separator="|") == "1|\\x00ff|NULL|ca"
    assert row._cache is None  # rendering did not decode the row into objects


# --------------------------------------------------------------------------- authentication helpers


def test_scram_sha_256_rfc7677_vector() -> None:
    client = ScramSha256Client("pencil", username="user", nonce="rOprNGfwEbeRWgbNEkqO")
    assert client.mechanism == "SCRAM-SHA-256"
    assert client.client_first_message() == b"n,,n=user,r=rOprNGfwEbeRWgbNEkqO"
    server_first = b"r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096"
    assert client.client_final_message(server_first) == (
        b"c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ="
    )
    # The brief quoted "...nLTJ+ZjJ2fPc=", a corrupted copy; RFC 7677 section 3 says "...nLTJRsjl95G4=".
    with pytest.raises(ScramError):
        client.verify_server_final(b"v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJ+ZjJ2fPc=")
    assert not client.done
    client.verify_server_final(b"v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4=")
    assert client.done


def test_scram_rejects_bad_server_messages() -> None:
    server_first = "r=abcdefXYZ,s=" + base64.b64encode(b"salt").decode() + ",i=4096"
    client = ScramSha256Client("pw", nonce="abcdef")
    client.client_final_message(server_first)
    with pytest.raises(ScramError):
        client.verify_server_final("v=" + base64.b64encode(b"\0" * 32).decode())
    with pytest.raises(ScramError):
        client.verify_server_final("e=invalid-proof")
    assert not client.done
    for bad in [
        "r=zzz,s=c2FsdA==,i=4096",  # nonce does not extend ours
        "r=abcdef,s=c2FsdA==,i=4096",  # nonce not extended at all
        "r=abcdefX,s=!!!,i=4096",  # bad base64
        "r=abcdefX,s=c2FsdA==,i=0",
        "r=abcdefX,s=c2FsdA==,i=99999999999",
        "r=abcdefX,s=c2FsdA==",
        "m=ext,r=abcdefX,s=c2FsdA==,i=1",
        "garbage",
    ]:
        with pytest.raises(ScramError):
            ScramSha256Client("pw", nonce="abcdef").client_final_message(bad)
    with pytest.raises(ScramError):
        ScramSha256Client("pw").verify_server_final("v=abc")


def test_scram_matches_independent_computation_with_channel_binding() -> None:
    cb = b"\x11" * 32
    client = ScramSha256Client("secret", nonce="NONCE", channel_binding=("tls-server-end-point", cb))
    assert client.mechanism == "SCRAM-SHA-256-PLUS"
    assert client.client_first_message() == b"p=tls-server-end-point,,n=,r=NONCE"
    salt = b"0123456789abcdef"
    server_first = f"r=NONCEserver,s={base64.b64encode(salt).decode()},i=16"
    final = client.client_final_message(server_first.encode()).decode()
    cbind = base64.b64encode(b"p=tls-server-end-point,," + cb).decode()
    without_proof = f"c={cbind},r=NONCEserver"
    auth = f"n=,r=NONCE,{server_first},{without_proof}".encode()
    salted = hashlib.pbkdf2_hmac("sha256", b"secret", salt, 16)
    client_key = hmac.new(salted, b"Client Key", hashlib.sha256).digest()
    signature = hmac.new(hashlib.sha256(client_key).digest(), auth, hashlib.sha256).digest()
    proof = base64.b64encode(bytes(x ^ y for x, y in zip(client_key, signature))).decode()
    assert final == f"{without_proof},p={proof}"
    server_sig = hmac.new(hmac.new(salted, b"Server Key", hashlib.sha256).digest(), auth, hashlib.sha256).digest()
    client.verify_server_final(b"v=" + base64.b64encode(server_sig))


def test_scram_says_it_could_bind_when_the_server_offered_no_binding_over_tls() -> None:
    """The gs2 header "y": a server that does offer SCRAM-SHA-256-PLUS (someone in between struck it from the list)
    then fails the exchange; the header is part of the proof (``c=``)."""
    client = ScramSha256Client("secret", nonce="NONCE", binding_supported=True)
    assert client.mechanism == "SCRAM-SHA-256" and client.client_first_message() == b"y,,n=,r=NONCE"
    final = client.client_final_message(f"r=NONCEserver,s={base64.b64encode(b'salt').decode()},i=16".encode())
    assert final.startswith(f"c={base64.b64encode(b'y,,').decode()},r=NONCEserver,p=".encode())


def test_md5_password() -> None:
    salt = b"\x01\x02\x03\x04"
    inner = hashlib.md5(b"secretalice").hexdigest()
    expected = "md5" + hashlib.md5(inner.encode() + salt).hexdigest()
    assert pg.md5_password("alice", "secret", salt) == expected
    message = pg.decode_frontend(pg.encode_password(pg.md5_password("alice", "secret", salt)))
    assert message.password == expected and len(expected) == 35


def test_saslprep() -> None:
    assert pg.saslprep("plain ascii\x07") == "plain ascii\x07"  # ASCII passes through, as in PostgreSQL
    assert pg.saslprep("I\u00adX") == "IX"  # soft hyphen maps to nothing
    assert pg.saslprep("\u2168") == "IX"  # NFKC
    assert pg.saslprep("a\u00a0b") == "a b"  # non-ASCII space
    with pytest.raises(ValueError):
        pg.saslprep("\u00e9\u0007")
    with pytest.raises(ValueError):
        pg.saslprep("\u0627\u0031")  # RandALCat not at the end
    # Prohibited passwords are used raw, like PostgreSQL does.
    raw = ScramSha256Client("\u00e9\u0007", nonce="n")._password
    assert raw == "\u00e9\u0007".encode()


# --------------------------------------------------------------------------- property tests


def exercise(reader: pg._FrameBuffer, data: bytes, eof: bool = True) -> None:
    """Feed data; the reader must produce messages, ask for more, or raise ProtocolError -- nothing else."""
    try:
        reader.feed(data)
        if eof:
            reader.feed_eof()
        for message in drain(reader, limit=len(data) + 2):
            try:
                message.to_dict()
                repr(message)
                if isinstance(message, pg.DataRow):
                    pg.render_row(None, message)
                    message.column_views()
            except ProtocolError:
                pass
    except ProtocolError as exc:
        assert exc.sqlstate in ("08P01", "0A000")


@FUZZ
@given(st.binary(max_size=2048))
def test_fuzz_random_bytes(data: bytes) -> None:
    exercise(FrontendReader(), data)
    exercise(FrontendReader(expect_startup=False), data)
    exercise(BackendReader(), data)
    exercise(BackendReader(max_message_size=64), data, eof=False)


backend_messages = st.sampled_from([f for f, _, _ in BACKEND_CASES])
frontend_messages = st.sampled_from([f for f, _, _ in FRONTEND_CASES])


@FUZZ
@given(st.lists(backend_messages, min_size=1, max_size=20), st.data())
def test_fuzz_truncated_frames(messages: list[bytes], data: st.DataObject) -> None:
    stream = b"".join(messages)
    cut = data.draw(st.integers(0, len(stream) - 1))
    reader = BackendReader()
    reader.feed(stream[:cut])
    complete = drain(reader)
    assert b"".join(bytes(m) for m in complete) == stream[: sum(len(m) for m in complete)]
    reader.feed_eof()
    if reader.buffered:
        with pytest.raises(ProtocolError):
            reader.next_message()
    else:
        assert reader.next_message() is None


@FUZZ
@given(
    st.sampled_from([b"Q", b"D", b"d", b"B", b"T", b"\x00", b"\xff"]),
    st.integers(min_value=-(2**31), max_value=2**31 - 1),
    st.binary(max_size=64),
)
def test_fuzz_declared_lengths(kind: bytes, length: int, tail: bytes) -> None:
    data = kind + struct.pack("!i", length) + tail
    limit = 1000
    for reader in (FrontendReader(expect_startup=False, max_message_size=limit), BackendReader(max_message_size=limit)):
        reader.feed(data)
        if length < 4 or length > limit:
            with pytest.raises(ProtocolError):
                reader.next_message()
        elif length + 1 > len(data):
            assert reader.next_message() is None  # waits for more, never loops
        else:
            assert len(reader.next_message()) == length + 1
    startup = FrontendReader()
    startup.feed(struct.pack("!i", length) + tail)
    exercise(startup, b"")


@FUZZ
@given(st.lists(backend_messages, min_size=1, max_size=30), st.lists(st.integers(0, 4000), max_size=12))
def test_fuzz_random_splits_backend(messages: list[bytes], cuts: list[int]) -> None:
    stream = b"".join(messages)
    cuts = [c for c in cuts if 0 < c < len(stream)]
    parsed = parse_in_pieces(BackendReader, stream, cuts)
    assert [bytes(m) for m in parsed] == messages
    for message in parsed:
        message.validate()


@FUZZ
@given(st.lists(frontend_messages, min_size=1, max_size=30), st.lists(st.integers(0, 4000), max_size=12))
def test_fuzz_random_splits_frontend(messages: list[bytes], cuts: list[int]) -> None:
    messages = [pg.encode_startup_message({"user": "u"})] + messages
    stream = b"".join(messages)
    cuts = [c for c in cuts if 0 < c < len(stream)]
    parsed = parse_in_pieces(FrontendReader, stream, cuts)
    assert [bytes(m) for m in parsed] == messages


@FUZZ
@given(st.lists(backend_messages, min_size=1, max_size=10), st.data())
def test_fuzz_corrupted_streams(messages: list[bytes], data: st.DataObject) -> None:
    stream = bytearray(b"".join(messages))
    for _ in range(data.draw(st.integers(1, 4))):
        stream[data.draw(st.integers(0, len(stream) - 1))] = data.draw(st.integers(0, 255))
    exercise(BackendReader(), bytes(stream))
    exercise(FrontendReader(expect_startup=False), bytes(stream))


ALL_TYPE_BYTES = sorted({f[:1] for f, _, _ in BACKEND_CASES + FRONTEND_CASES} | {b"p", b"Y"})


def touch(message: pg.Message) -> None:
    """Read every accessor; only ProtocolError may come out."""
    names = [n for n in dir(type(message)) if not n.startswith("_") and n not in ("TYPE", "validate", "to_dict")]
    for name in names:
        try:
            value = getattr(message, name)
            if callable(value) and name in ("column_views", "sasl_initial_response"):
                value()
            elif name == "param_is_binary":
                for i in range(len(message.params)):
                    value(i)
        except ProtocolError:
            pass
    for call in (message.validate, message.to_dict, lambda: repr(message)):
        try:
            call()
        except ProtocolError:
            pass
    if isinstance(message, pg.DataRow):
        for formats in (None, [1] * 8):
            try:
                pg.render_row(None, message, formats=formats, max_column_bytes=3)
            except ProtocolError:
                pass


@FUZZ
@given(st.sampled_from(ALL_TYPE_BYTES), st.binary(max_size=300))
def test_fuzz_message_bodies(kind: bytes, body: bytes) -> None:
    frame = pg.encode_message(kind, body)
    touch(pg.decode_backend(frame))
    touch(pg.decode_frontend(frame))


@FUZZ
@given(
    st.sampled_from([pg.PROTOCOL_3_0, pg.PROTOCOL_3_2, pg.CANCEL_REQUEST_CODE, pg.SSL_REQUEST_CODE]),
    st.binary(max_size=300),
)
def test_fuzz_startup_bodies(code: int, body: bytes) -> None:
    reader = FrontendReader()
    try:
        reader.feed(struct.pack("!iI", len(body) + 8, code) + body)
        message = reader.next_message()
    except ProtocolError:
        return
    assert message is not None
    touch(message)
