"""Protocol descriptions: what the core, the API and the configuration know of each protocol proxy.

Each package under ``proxies/`` declares one ``ProtocolDescription`` and the
composition root registers it (``proxies/__init__.py``: one line per protocol).
The core never names a protocol: the session types, the credential prefixes,
the ``[listeners]`` keys and each proxy's own ``[section]``, the serverconfig
document, the listeners and the access hints all come from iterating over
``registered()``.  A new protocol is its package plus one registration line.

The names that the hoop.dev API contract fixes (the ``httpproxy`` subtype, the
``http_proxy_server_config`` key, the ``httpproxy-`` prefix) are written once,
in the HTTP package's description.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from gatewayd import hotpath
from gatewayd.languages import SQL, TEXT, Language
from gatewayd.models import Session, new_id, rfc3339, utcnow

if TYPE_CHECKING:
    import socket

    from gatewayd.models import Connection, User
    from gatewayd.scripts import ScriptRunner
    from gatewayd.settings import Setting

# (connection, secret, host, port, the protocol's settings) -> what the user types (the API's connection_credentials)
AccessHints = Callable[["Connection", str, str, int, dict[str, Any]], dict[str, str]]
# (its gatewayd.pipeline.ProxyContext, host, port) -> a started Listener (the context is built above this layer)
Start = Callable[[Any, str, int], Awaitable[Any]]
# (the local client's reader and writer, the credential secret) -> the client's opening bytes with the secret in
# place, to send to the gateway's own listener: how the proxy manager forwards a local client (gatewayd.agent.manager)
ForwardOpening = Callable[[Any, Any, str], Awaitable[bytes]]
ForwardServe = Callable[["socket.socket", str], Awaitable[None]]  # (a connected socket, the credential's secret)
CheckSettings = Callable[[dict[str, Any]], "str | None"]  # a connection's settings -> what is wrong with them, or None


# How a protocol's recordings are shown (the console's viewer, the CLI's `sessions show`, the export formats)
STATEMENTS = "statements"  # statement by statement, with results (a SQL language's default)
TERMINAL = "terminal"  # a terminal's output, replayed at its pace (asciicast)
FRAMES = "frames"  # screen frames (PNG)
EXCHANGES = "exchanges"  # requests and their answers
TEXT_VIEW = "text"  # the events as text, one a line (every other language's default)
PRESENTATIONS = (STATEMENTS, TERMINAL, FRAMES, EXCHANGES, TEXT_VIEW)


@dataclass(slots=True, frozen=True)
class ClientCommand:
    """The native client the CLI's ``connect`` starts with a credential: a template over its access hints.

    Each of ``args``, each value of ``env`` and ``shown`` may name an access hint in braces (``{hostname}``,
    ``{port}``, ``{username}``, ``{password}``, ``{database_name}``, ``{command}``...); an argument that
    comes out empty is left out.  ``programs``: the first installed one runs (``mysql`` or ``mariadb``).
    ``options_with_value``: the user's arguments go after the program's (empty), or, for a client that
    reads ``[options] destination [command]`` (ssh), its options before the last argument and the rest
    after it; these letters are its options that take a value.  ``files``: (name, template) of the files the
    CLI writes for the client, readable by their owner only and removed when it exits; an argument or a
    variable names one's path as ``{file_<name>}`` (a secret the client reads only as an argument, such as
    ssh's user name, goes there: an argument is in the process list for every local user to read).
    """

    programs: tuple[str, ...]
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    shown: str = "{command}"  # what the CLI prints (`connect --print`, or when the client is not installed)
    options_with_value: str = ""
    files: tuple[tuple[str, str], ...] = ()

    def as_json(self) -> dict[str, Any]:
        return {"programs": list(self.programs), "args": list(self.args), "env": dict(self.env),
                "shown": self.shown, "options_with_value": self.options_with_value, "files": dict(self.files)}


def lazy_start(module: str) -> Start:
    """The ``start`` of the server ``module`` a package names, imported when its listener first starts.

    A description stays cheap to import (and RDP's describes itself without pyrdp).
    """
    async def start(context: Any, host: str, port: int) -> Any:
        return await importlib.import_module(module).start(context, host, port)

    return start


def lazy_script_runner(module: str) -> Callable[[], ScriptRunner]:
    """A loader of the ``run_script`` of ``module``, imported when a one-time script first runs."""
    return lambda: importlib.import_module(module).run_script

@dataclass(slots=True, frozen=True)
class ProtocolDescription:
    """One protocol proxy as the rest of the gateway sees it.

    ``name`` names its listener (``[listeners] <name>``) and its configuration section
    (``[<name>]``, keys in ``settings`` without the section); ``subtype`` is the connection
    subtype it serves (and the ``<subtype>.login`` audit action); ``session_type`` the type of
    its sessions; ``prefix`` starts its credential secrets (``<prefix>-...``).  ``start`` (the
    listener factory) and ``load_script_runner`` import the proxy's server modules only when
    called, so that describing a protocol costs nothing and a protocol whose extra is missing
    still describes itself (``available()`` is then false and ``missing_modules()`` names what to
    install).
    """

    name: str
    subtype: str
    session_type: str
    prefix: str
    server_config_key: str
    default_port: int
    access_hints: AccessHints
    start: Start
    settings: dict[str, Setting] = field(default_factory=dict)
    load_script_runner: Callable[[], ScriptRunner] | None = None  # one-time scripts (POST /sessions), if any
    required_modules: tuple[str, ...] = ()
    install_hint: str = ""  # said in the log when ``required_modules`` are missing
    forward_opening: ForwardOpening | None = None  # the proxy manager forwards this protocol's local clients
    # ... or hands each one to the running proxy with the credential (SSH: the client's own login is encrypted)
    forward_serve: ForwardServe | None = None
    # what is wrong with a connection's ``settings`` for this protocol (its own keys), said as a 422; None: fine
    check_settings: CheckSettings | None = None
    # the keys a connection may set under ``settings.<name>`` (any other is refused: a misspelled one did nothing)
    connection_settings: tuple[str, ...] = ()
    # what its input is written in (gatewayd.languages): how guard rails and analysis read it, which rules apply
    language: Language = TEXT
    title: str = ""  # how people call it ("PostgreSQL"); default: its name
    # how its recordings are shown (PRESENTATIONS); default: statements for a SQL language, else text
    presentation: str = ""
    client: ClientCommand | None = None  # what the CLI's `connect` starts; None: the access hints' url, in a browser
    compiled: tuple[str, ...] = ()  # its hot-path modules, built with Cython (gatewayd.hotpath)

    def __post_init__(self) -> None:
        if not self.title:
            object.__setattr__(self, "title", self.name)
        if not self.presentation:
            object.__setattr__(self, "presentation", STATEMENTS if self.language.family == SQL else TEXT_VIEW)
        if self.presentation not in PRESENTATIONS:
            raise ValueError(f"protocol {self.name!r}: presentation {self.presentation!r} is none of "
                             f"{', '.join(PRESENTATIONS)}")

    @property
    def exports(self) -> tuple[str, ...]:
        """The formats its sessions export to: csv and json (statements) for a SQL language, asciicast for a
        terminal, png-frames for frames, text for every one."""
        return ((("csv", "json") if self.language.family == SQL else ())
                + {TERMINAL: ("asciicast",), FRAMES: ("png-frames",)}.get(self.presentation, ()) + ("text",))

    @property
    def default_listen(self) -> str:
        return f"127.0.0.1:{self.default_port}"

    def missing_modules(self) -> list[str]:
        """The modules this proxy needs that are not installed (an optional extra)."""
        return [name for name in self.required_modules if importlib.util.find_spec(name) is None]

    def available(self) -> bool:
        return not self.missing_modules()

    def script_runner(self) -> ScriptRunner | None:
        return self.load_script_runner() if self.load_script_runner is not None else None


_REGISTRY: dict[str, ProtocolDescription] = {}


def register(description: ProtocolDescription) -> ProtocolDescription:
    """Add a protocol; registering the same description again is a no-op, a clashing one an error."""
    if "-" in description.prefix or not description.prefix:
        raise ValueError(f"protocol {description.name!r}: a credential prefix is a word without '-'")
    current = _REGISTRY.get(description.name)
    if current == description:
        return description
    if current is not None:
        raise ValueError(f"protocol {description.name!r} is registered already")
    for other in _REGISTRY.values():
        for attribute in ("subtype", "prefix", "server_config_key"):
            if getattr(other, attribute) == getattr(description, attribute):
                raise ValueError(f"protocol {description.name!r}: {attribute} {getattr(description, attribute)!r} "
                                 f"is {other.name!r}'s already")
    _REGISTRY[description.name] = description
    hotpath.add(description.compiled)  # its modules run compiled where built (the core lists only its own)
    return description


def unregister(name: str) -> None:
    """Remove a protocol (tests that register one of their own)."""
    _REGISTRY.pop(name, None)


def registered() -> tuple[ProtocolDescription, ...]:
    """Every registered protocol, in registration order."""
    return tuple(_REGISTRY.values())


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def by_name(name: str) -> ProtocolDescription | None:
    return _REGISTRY.get(name)


def by_subtype(subtype: str) -> ProtocolDescription | None:
    for description in _REGISTRY.values():
        if description.subtype == subtype:
            return description
    return None


def language_of(subtype: str) -> Language:
    """The language of a connection's input, from its protocol (plain text for a subtype no protocol serves)."""
    description = by_subtype(subtype)
    return description.language if description is not None else TEXT


def presentation_of(subtype: str) -> str:
    """How a connection's recordings are shown, from its protocol (text for a subtype no protocol serves)."""
    description = by_subtype(subtype)
    return description.presentation if description is not None else TEXT_VIEW


def session_for(user: User, connection: Connection, *, verb: str = "connect", status: str = "open",
                session_id: str | None = None, **extra: Any) -> Session:
    """A new session record of ``user`` on ``connection`` (its type is its protocol's session type)."""
    description = by_subtype(connection.subtype)
    session_type = description.session_type if description is not None else connection.type
    return Session(
        id=session_id or new_id(), org_id=connection.org_id, user_id=user.subject, user_email=user.email,
        user_name=user.name, connection=connection.name, connection_id=connection.id,
        resource_name=connection.resource_name, type=session_type, subtype=connection.subtype,
        verb=verb, status=status, tags=dict(connection.tags), start_date=rfc3339(utcnow()), **extra,
    )


def by_prefix(prefix: str) -> ProtocolDescription | None:
    for description in _REGISTRY.values():
        if description.prefix == prefix:
            return description
    return None
