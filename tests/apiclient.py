"""The control API as the end-to-end tests use it: one client class, plus the connection secrets of each peer."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

import aiohttp

from tests.openapi_check import check_answer

if TYPE_CHECKING:
    from tests.conftest import Daemon
    from tests.pgpeer import PgCluster
    from tests.sshpeer import SshTarget


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def events(session: dict) -> list[tuple[str, str]]:
    """(kind, text) of each event of a session fetched with ``expand=event_stream``."""
    return [(kind, base64.b64decode(data).decode("utf-8", "replace")) for _, kind, data in session["event_stream"]]


def of_kind(session: dict, kind: str) -> list[str]:
    """The texts of a session's events of one kind."""
    return [text for k, text in events(session) if k == kind]


@contextlib.asynccontextmanager
async def admin_http(daemon: Daemon) -> AsyncIterator[aiohttp.ClientSession]:
    """An HTTP client session that sends an admin's token with every request."""
    token = daemon.token("admin@example.com", groups="admin", name="Ada Admin")
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as http:
        yield http


class Api:
    """The control API as one user (``token``, else whoever the session's headers say), with test helpers."""

    secret_field = "username"  # where a credential's secret is in ``connection_credentials``
    session_timeout: float = 10  # how long ``done_session`` waits by default
    poll_interval: float = 0.05

    def __init__(self, daemon: Daemon, http: aiohttp.ClientSession, token: str | None = None) -> None:
        self.daemon = daemon
        self.http = http
        self.headers = {"Authorization": f"Bearer {token}"} if token else None

    async def __call__(self, method: str, path: str, body: Any = None, token: str | None = None) -> tuple[int, Any]:
        """(status, body) of one request; ``token`` speaks as another user for this one."""
        headers = {"Authorization": f"Bearer {token}"} if token else self.headers
        async with self.http.request(method, self.daemon.url + path, json=body, headers=headers) as response:
            data = await self.decode(response)
            if response.content_type == "application/json":
                check_answer(self.daemon.url, method, path, response.status, data)
            return response.status, data

    async def decode(self, response: aiohttp.ClientResponse) -> Any:
        """The body: JSON where it parses, else the text (None when empty)."""
        text = await response.text()
        try:
            return json.loads(text) if text else None
        except ValueError:
            return text

    async def connection(self, name_prefix: str, type: str, subtype: str, env: dict[str, str],
                         settings: dict | None = None, **fields: Any) -> dict:
        """A new connection with a unique name; ``env`` holds the secret's plain values (``HOST``, ...)."""
        body: dict[str, Any] = {"name": f"{name_prefix}-{uuid.uuid4().hex[:8]}", "type": type, "subtype": subtype,
                                "secret": {f"envvar:{key}": b64(value) for key, value in env.items()}, **fields}
        if settings is not None:
            body["settings"] = settings
        status, created = await self("POST", "/connections", body)
        assert status == 201, created
        return created

    async def credential(self, connection: dict, seconds: int = 600, token: str | None = None) -> tuple[str, str]:
        """(secret, session id) of a fresh credential."""
        status, body = await self("POST", f"/connections/{connection['name']}/credentials",
                                  {"access_duration_seconds": seconds}, token=token)
        assert status == 201, body
        return body["connection_credentials"][self.secret_field], body["session_id"]

    async def signed_in_user(self) -> tuple[str, str]:
        """A new user of the caller's organization (not an admin), signed in with a password: (its e-mail, its
        token)."""
        email, password = f"dora-{uuid.uuid4().hex[:8]}@example.com", "a long enough password"
        status, body = await self("POST", "/users", {"email": email, "password": password})
        assert status == 201, body
        status, body = await self("POST", "/localauth/login", {"email": email, "password": password})
        assert status == 200, body
        return email, body["token"]

    async def guardrail(self, connection: dict, input_rules: list | None = None,
                        output_rules: list | None = None) -> dict:
        status, body = await self("POST", "/guardrails", {
            "name": f"rail-{uuid.uuid4().hex[:8]}", "connection_ids": [connection["id"]],
            "input": {"rules": input_rules or []}, "output": {"rules": output_rules or []}})
        assert status == 201, body
        return body

    async def session(self, session_id: str, until: Callable[[dict], bool] | None = None,
                      timeout: float | None = None) -> dict:
        """The session with its event stream, once ``until(session)`` holds (at once without ``until``)."""
        deadline = time.monotonic() + (self.session_timeout if timeout is None else timeout)
        while True:
            status, body = await self("GET", f"/sessions/{session_id}?expand=event_stream")
            assert status == 200, body
            if until is None or until(body):
                return body
            if time.monotonic() > deadline:
                raise AssertionError(f"session {session_id} never got there: {body['status']}, "
                                     f"{events(body)[-5:]}")
            await asyncio.sleep(self.poll_interval)

    async def done_session(self, session_id: str, timeout: float | None = None, busy_store: bool = False) -> dict:
        """The session once it is ``done``, with its event stream; ``busy_store``: a 503 "try again later" (a
        store read past ``store.timeout``) is tried again."""
        deadline = time.monotonic() + (self.session_timeout if timeout is None else timeout)
        while True:
            status, body = await self("GET", f"/sessions/{session_id}?expand=event_stream")
            if busy_store and status == 503 and time.monotonic() < deadline:
                await asyncio.sleep(self.poll_interval)
                continue
            assert status == 200, body
            if body["status"] == "done":
                return body
            if time.monotonic() > deadline:
                raise AssertionError(f"session {session_id} is still {body['status']}")
            await asyncio.sleep(self.poll_interval)


def postgres_env(cluster: PgCluster, user: str = "postgres", password: str | None = None, db: str = "postgres",
                 port: int | None = None, sslmode: str | None = None, **more: str) -> dict[str, str]:
    """The secret of a postgres connection to ``cluster`` (``more``: other settings, SSLROOTCERT=...)."""
    env = {"HOST": "127.0.0.1", "PORT": str(port or cluster.port), "USER": user,
           "PASS": password or cluster.password, "DB": db, **more}
    if sslmode:
        env["SSLMODE"] = sslmode
    return env


class PostgresApi(Api):
    """The control API with postgres connections to one cluster."""

    def __init__(self, daemon: Daemon, http: aiohttp.ClientSession, cluster: PgCluster,
                 token: str | None = None) -> None:
        super().__init__(daemon, http, token)
        self.cluster = cluster

    async def role(self, user: str = "postgres", password: str | None = None, db: str = "postgres",
                   port: int | None = None, sslmode: str | None = None, settings: dict | None = None,
                   **more: str) -> dict:
        """A new postgres connection to the cluster, with a unique name (``more``: other secret settings)."""
        return await self.connection("pg", "database", "postgres",
                                     postgres_env(self.cluster, user, password, db, port, sslmode, **more), settings)


class MySqlApi(Api):
    """The control API with mysql connections to one MariaDB server (tests/mypeer.py)."""

    def __init__(self, daemon: Daemon, http: aiohttp.ClientSession, server: Any, token: str | None = None) -> None:
        super().__init__(daemon, http, token)
        self.server = server

    async def role(self, user: str = "app", password: str | None = None, db: str = "app", port: int | None = None,
                   sslmode: str | None = None, settings: dict | None = None, **more: str) -> dict:
        """A new mysql connection to the server, with a unique name (``more``: other secret settings)."""
        env = {"HOST": "127.0.0.1", "PORT": str(port or self.server.port), "USER": user,
               "PASS": self.server.password if password is None else password, "DB": db, **more}
        if sslmode:
            env["SSLMODE"] = sslmode
        return await self.connection("my", "database", "mysql", env, settings)


class SshApi(Api):
    """The control API with ssh connections to one sshd."""

    session_timeout = 20

    def __init__(self, daemon: Daemon, http: aiohttp.ClientSession, target: SshTarget,
                 token: str | None = None) -> None:
        super().__init__(daemon, http, token)
        self.target = target

    async def role(self, *, password: bool = False, key: str | None = None, port: int | None = None,
                   host_key: str | None = None, settings: dict | None = None, env_more: dict | None = None,
                   **fields: Any) -> dict:
        """A new ssh connection to the target (key login unless ``password``), with a unique name (``env_more``:
        other secret settings)."""
        env = {"HOST": "127.0.0.1", "PORT": str(port or self.target.port), "USER": self.target.user, **(env_more or {})}
        if password:
            env["PASS"] = self.target.password
        else:
            env["PRIVATE_KEY"] = key or self.target.private_key_text
        if host_key is not None:
            env["HOST_KEY"] = host_key
        return await self.connection("ssh", "custom", "ssh", env, settings or {}, **fields)
