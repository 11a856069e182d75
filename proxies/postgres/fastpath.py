"""The fast-path FunctionCall message: which functions a connection lets through it, and how it is recorded.

A FunctionCall names a function by OID and carries its arguments as bound
values: no SQL for the guard rails to read.  libpq's large-object functions
(``\\lo_export``, ``\\lo_import``, ``lo_read``...) and pgjdbc's
``LargeObjectManager`` and ``Fastpath`` use it.  On a connection with input
rules a FunctionCall is refused unless its function is on the connection's
allow list (``settings.postgres.function_calls``: names from
``FUNCTIONS``, or ``"large_objects"`` for all of them); every FunctionCall is
recorded as the call it is, and its result is masked and recorded like a
row (docs/guardrail-readings.md).

The OIDs are PostgreSQL's built-in ones (``pg_proc.dat``): fixed across
versions, and below FirstNormalObjectId, so no function a user creates can
take one.  tests/test_sql_readings.py holds them to a real server's catalog.
"""

from __future__ import annotations

from typing import Any

LARGE_OBJECTS = {
    "lo_open": 952, "lo_close": 953, "loread": 954, "lowrite": 955, "lo_lseek": 956, "lo_creat": 957,
    "lo_tell": 958, "lo_unlink": 964, "lo_truncate": 1004, "lo_create": 715, "lo_lseek64": 3170,
    "lo_tell64": 3171, "lo_truncate64": 3172,
}
FUNCTIONS = dict(LARGE_OBJECTS)  # what an allow list may name
NAMES = {oid: name for name, oid in FUNCTIONS.items()}
SETTING = "settings.postgres.function_calls"


class FunctionCallSettingError(ValueError):
    """A connection's ``settings.postgres.function_calls`` that names what the gateway does not know (a 400)."""


def allowed_functions(settings: dict[str, Any]) -> frozenset[int]:
    """The OIDs a connection's settings let through a FunctionCall under input rules (none by default)."""
    postgres = settings.get("postgres") if isinstance(settings, dict) else None
    names = postgres.get("function_calls") if isinstance(postgres, dict) else None
    if not isinstance(names, list):
        return frozenset()
    oids: set[int] = set()
    for name in names:
        if name == "large_objects":
            oids.update(LARGE_OBJECTS.values())
        elif isinstance(name, str) and name in FUNCTIONS:
            oids.add(FUNCTIONS[name])
    return frozenset(oids)


def check_settings(settings: dict[str, Any]) -> None:
    """Raise FunctionCallSettingError when ``settings.postgres.function_calls`` names an unknown function."""
    postgres = settings.get("postgres") if isinstance(settings, dict) else None
    names = postgres.get("function_calls") if isinstance(postgres, dict) else None
    if names is None:
        return
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise FunctionCallSettingError(f"{SETTING}': expected an array of function names")
    unknown = [n for n in names if n != "large_objects" and n not in FUNCTIONS]
    if unknown:
        raise FunctionCallSettingError(f"{SETTING}': unknown function {', '.join(map(repr, unknown))}: "
                                       f"one of large_objects, {', '.join(sorted(FUNCTIONS))}")


def function_name(oid: int) -> str:
    """How a FunctionCall's function is named in the recording and in a refusal."""
    name = NAMES.get(oid)
    return f"pg_catalog.{name}" if name is not None else f"function with OID {oid}"


def call_sql(oid: int, count: int) -> str:
    """The SQL a FunctionCall stands for (its arguments as parameters: ``render_params`` adds them)."""
    name = NAMES.get(oid)
    called = f"pg_catalog.{name}" if name is not None else f"\"function OID {oid}\""
    return f"select {called}({', '.join(f'${i + 1}' for i in range(count))}) -- fast-path FunctionCall"
