"""PostgreSQL v3 messages made by the gateway: ``encode_*`` functions returning ``bytes`` ready to send
(the answers it gives a client itself, what it says to a target as a client)."""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence

from proxies.postgres.messages import FieldDescription
from proxies.postgres.wire import (
    AUTH_CLEARTEXT_PASSWORD,
    AUTH_MD5_PASSWORD,
    AUTH_OK,
    AUTH_SASL,
    AUTH_SASL_CONTINUE,
    AUTH_SASL_FINAL,
    CANCEL_REQUEST_CODE,
    GSSENC_REQUEST_CODE,
    PROTOCOL_3_0,
    SSL_REQUEST_CODE,
)

# --------------------------------------------------------------------------- writers


def encode_message(type_code: bytes, body: bytes = b"") -> bytes:
    """A typed message: type byte, Int32 length (itself included), body."""
    return type_code + (len(body) + 4).to_bytes(4, "big") + body


def _cstr(value: str | bytes) -> bytes:
    raw = value.encode() if isinstance(value, str) else bytes(value)
    if b"\0" in raw:
        raise ValueError("protocol strings cannot contain NUL bytes")
    return raw + b"\0"


def _int16s(values: Sequence[int]) -> bytes:
    return struct.pack(f"!H{len(values)}h", len(values), *values)


def _oids(values: Sequence[int]) -> bytes:
    return struct.pack(f"!H{len(values)}I", len(values), *values)


def _values(values: Sequence[bytes | str | None]) -> bytes:
    parts = [len(values).to_bytes(2, "big")]
    for value in values:
        if value is None:
            parts.append(b"\xff\xff\xff\xff")
        else:
            raw = value.encode() if isinstance(value, str) else bytes(value)
            parts.append(len(raw).to_bytes(4, "big"))
            parts.append(raw)
    return b"".join(parts)


def _untyped(code: int, body: bytes = b"") -> bytes:
    return struct.pack("!iI", len(body) + 8, code) + body


# ----- frontend


def encode_startup_message(parameters: Mapping[str, str], protocol: int = PROTOCOL_3_0) -> bytes:
    """StartupMessage with the given parameters (``user`` is required by servers)."""
    body = b"".join(_cstr(k) + _cstr(v) for k, v in parameters.items()) + b"\0"
    return _untyped(protocol, body)


def encode_ssl_request() -> bytes:
    return _untyped(SSL_REQUEST_CODE)


def encode_gssenc_request() -> bytes:
    return _untyped(GSSENC_REQUEST_CODE)


def encode_cancel_request(process_id: int, secret_key: bytes | int) -> bytes:
    """CancelRequest; an int key is packed as the 4-byte key of protocol 3.0."""
    key = secret_key.to_bytes(4, "big", signed=secret_key < 0) if isinstance(secret_key, int) else bytes(secret_key)
    return _untyped(CANCEL_REQUEST_CODE, struct.pack("!i", process_id) + key)


def encode_password(password: str | bytes) -> bytes:
    """PasswordMessage: cleartext, or the ``md5...`` string from ``md5_password``."""
    return encode_message(b"p", _cstr(password))


def encode_sasl_initial_response(mechanism: str, data: bytes | None) -> bytes:
    body = _cstr(mechanism) + (b"\xff\xff\xff\xff" if data is None else len(data).to_bytes(4, "big") + data)
    return encode_message(b"p", body)


def encode_sasl_response(data: bytes) -> bytes:
    return encode_message(b"p", bytes(data))


def encode_query(sql: str | bytes) -> bytes:
    return encode_message(b"Q", _cstr(sql))


def encode_parse(name: str, sql: str | bytes, param_types: Sequence[int] = ()) -> bytes:
    return encode_message(b"P", _cstr(name) + _cstr(sql) + _oids(param_types))


def encode_bind(
    portal: str,
    statement: str,
    params: Sequence[bytes | str | None] = (),
    param_formats: Sequence[int] = (),
    result_formats: Sequence[int] = (),
) -> bytes:
    body = _cstr(portal) + _cstr(statement) + _int16s(param_formats) + _values(params) + _int16s(result_formats)
    return encode_message(b"B", body)


def _kind(kind: str) -> bytes:
    if kind not in ("S", "P"):
        raise ValueError("kind must be 'S' (statement) or 'P' (portal)")
    return kind.encode()


def encode_describe(kind: str, name: str = "") -> bytes:
    return encode_message(b"D", _kind(kind) + _cstr(name))


def encode_close(kind: str, name: str = "") -> bytes:
    return encode_message(b"C", _kind(kind) + _cstr(name))


def encode_execute(portal: str = "", max_rows: int = 0) -> bytes:
    return encode_message(b"E", _cstr(portal) + struct.pack("!i", max_rows))


def encode_sync() -> bytes:
    return b"S\0\0\0\x04"


def encode_flush() -> bytes:
    return b"H\0\0\0\x04"


def encode_terminate() -> bytes:
    return b"X\0\0\0\x04"


def encode_copy_data(data: bytes | bytearray | memoryview) -> bytes:
    return encode_message(b"d", bytes(data))


def encode_copy_done() -> bytes:
    return b"c\0\0\0\x04"


def encode_copy_fail(message: str) -> bytes:
    return encode_message(b"f", _cstr(message))


def encode_function_call(
    function_oid: int, args: Sequence[bytes | str | None] = (), arg_formats: Sequence[int] = (), result_format: int = 0
) -> bytes:
    body = struct.pack("!I", function_oid) + _int16s(arg_formats) + _values(args) + struct.pack("!h", result_format)
    return encode_message(b"F", body)


# ----- backend


def _auth(code: int, extra: bytes = b"") -> bytes:
    return encode_message(b"R", struct.pack("!i", code) + extra)


def encode_authentication_ok() -> bytes:
    return _auth(AUTH_OK)


def encode_authentication_cleartext_password() -> bytes:
    return _auth(AUTH_CLEARTEXT_PASSWORD)


def encode_authentication_md5_password(salt: bytes) -> bytes:
    if len(salt) != 4:
        raise ValueError("the MD5 salt is 4 bytes")
    return _auth(AUTH_MD5_PASSWORD, bytes(salt))


def encode_authentication_sasl(mechanisms: Sequence[str]) -> bytes:
    return _auth(AUTH_SASL, b"".join(_cstr(m) for m in mechanisms) + b"\0")


def encode_authentication_sasl_continue(data: bytes) -> bytes:
    return _auth(AUTH_SASL_CONTINUE, bytes(data))


def encode_authentication_sasl_final(data: bytes) -> bytes:
    return _auth(AUTH_SASL_FINAL, bytes(data))


def encode_parameter_status(name: str, value: str) -> bytes:
    return encode_message(b"S", _cstr(name) + _cstr(value))


def encode_backend_key_data(process_id: int, secret_key: bytes | int) -> bytes:
    key = secret_key.to_bytes(4, "big", signed=secret_key < 0) if isinstance(secret_key, int) else bytes(secret_key)
    return encode_message(b"K", struct.pack("!i", process_id) + key)


def encode_ready_for_query(status: str = "I") -> bytes:
    if status not in ("I", "T", "E"):
        raise ValueError("status must be 'I', 'T' or 'E'")
    return encode_message(b"Z", status.encode())


def encode_row_description(fields: Sequence[FieldDescription | str]) -> bytes:
    """RowDescription; a plain name stands for a text column."""
    parts = [len(fields).to_bytes(2, "big")]
    for field in fields:
        if isinstance(field, str):
            field = FieldDescription(field)
        parts.append(_cstr(field.name))
        parts.append(
            struct.pack(
                "!IhIhih", field.table_oid, field.column, field.type_oid, field.type_size, field.type_modifier,
                field.format,
            )
        )
    return encode_message(b"T", b"".join(parts))


def encode_data_row(columns: Sequence[bytes | str | None]) -> bytes:
    """DataRow; str values are sent as UTF-8 text, None as NULL."""
    return encode_message(b"D", _values(columns))


def encode_command_complete(tag: str) -> bytes:
    return encode_message(b"C", _cstr(tag))


def encode_empty_query_response() -> bytes:
    return b"I\0\0\0\x04"


def _fields_body(severity: str, sqlstate: str, message: str, extra: Mapping[str, str] | None) -> bytes:
    fields: dict[str, str] = {"S": severity, "V": severity, "C": sqlstate, "M": message}
    if extra:
        for code, value in extra.items():
            if len(code) != 1 or code == "\0":
                raise ValueError(f"error field codes are single letters, not {code!r}")
            fields[code] = value
    # NULs cannot travel in these strings; a message built from user text must not break the frame.
    return b"".join(code.encode() + _cstr(str(value).replace("\0", "\ufffd")) for code, value in fields.items()) + b"\0"


def encode_error_response(
    severity: str = "ERROR", sqlstate: str = "XX000", message: str = "", extra: Mapping[str, str] | None = None
) -> bytes:
    """ErrorResponse with S/V (severity), C (SQLSTATE), M (message) and ``extra`` fields by code letter (D, H, ...)."""
    return encode_message(b"E", _fields_body(severity, sqlstate, message, extra))


def encode_notice_response(
    severity: str = "NOTICE", sqlstate: str = "00000", message: str = "", extra: Mapping[str, str] | None = None
) -> bytes:
    return encode_message(b"N", _fields_body(severity, sqlstate, message, extra))


def encode_notification_response(process_id: int, channel: str, payload: str = "") -> bytes:
    return encode_message(b"A", struct.pack("!i", process_id) + _cstr(channel) + _cstr(payload))


def encode_parse_complete() -> bytes:
    return b"1\0\0\0\x04"


def encode_bind_complete() -> bytes:
    return b"2\0\0\0\x04"


def encode_close_complete() -> bytes:
    return b"3\0\0\0\x04"


def encode_no_data() -> bytes:
    return b"n\0\0\0\x04"


def encode_portal_suspended() -> bytes:
    return b"s\0\0\0\x04"


def encode_parameter_description(param_types: Sequence[int]) -> bytes:
    return encode_message(b"t", _oids(param_types))


def _copy_response(code: bytes, overall: int, column_formats: Sequence[int]) -> bytes:
    return encode_message(code, bytes([overall]) + _int16s(column_formats))


def encode_copy_in_response(overall: int = 0, column_formats: Sequence[int] = ()) -> bytes:
    return _copy_response(b"G", overall, column_formats)


def encode_copy_out_response(overall: int = 0, column_formats: Sequence[int] = ()) -> bytes:
    return _copy_response(b"H", overall, column_formats)


def encode_copy_both_response(overall: int = 0, column_formats: Sequence[int] = ()) -> bytes:
    return _copy_response(b"W", overall, column_formats)


def encode_negotiate_protocol_version(newest_minor: int, unrecognized_options: Sequence[str] = ()) -> bytes:
    body = struct.pack("!ii", newest_minor, len(unrecognized_options)) + b"".join(map(_cstr, unrecognized_options))
    return encode_message(b"v", body)


def encode_function_call_response(result: bytes | None) -> bytes:
    body = b"\xff\xff\xff\xff" if result is None else len(result).to_bytes(4, "big") + bytes(result)
    return encode_message(b"V", body)
