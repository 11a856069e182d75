"""Protocol descriptions: a new protocol is its package plus one registration line.

The ``line`` protocol below is tests/lineproxy.py described once and
registered: nothing else in the core, the API or the configuration names it,
yet its configuration section is accepted, serverconfig lists and moves its
listener, its credentials carry its prefix and resolve, and the composition
root starts its listener.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import aiohttp
import pytest

from gatewayd import protocols
from gatewayd.access import credential_prefix, looks_like_secret
from gatewayd.config import ConfigError, Setting, load_config, positive
from gatewayd.languages import SQL, Language
from gatewayd.models import Connection
from gatewayd.sql.postgresql import POSTGRESQL_DIALECT
from launcher.root import build_gateway
from tests import lineproxy
from tests.conftest import free_port
from tests.openapi_check import ResponseSchemas


async def _start(context: Any, host: str, port: int) -> Any:
    return await lineproxy.start(context, host, port, subtype="line")


def _hints(conn: Connection, secret: str, host: str, port: int, settings: dict[str, Any]) -> dict[str, str]:
    return {"hostname": host, "port": str(port), "command": f"printf '{secret}\\n{settings['greeting']}\\n' | "
                                                            f"nc {host} {port}"}


LINE = protocols.ProtocolDescription(
    name="line", subtype="line", session_type="custom", prefix="line", server_config_key="line_server_config",
    default_port=17777, access_hints=_hints, start=_start,
    settings={"greeting": Setting("str", "hello"), "max_lines": Setting("int", 10, positive)})


FAKE_SQL = protocols.ProtocolDescription(  # a second SQL protocol: what it reads is declared, never guessed
    name="fakesql", subtype="fakesql", session_type="database", prefix="fakesql",
    server_config_key="fakesql_server_config", default_port=17778, access_hints=_hints, start=_start,
    language=Language("fakesql", SQL, "fake SQL", POSTGRESQL_DIALECT))


@pytest.fixture
def fake_sql():
    protocols.register(FAKE_SQL)
    try:
        yield FAKE_SQL
    finally:
        protocols.unregister("fakesql")


async def test_a_second_sql_protocol_is_guarded_and_rated_as_sql_not_as_shell(fake_sql, tmp_path):
    """A protocol whose description names a SQL language: its guard rails read SQL (comments, statement kinds),
    its input is rated as SQL and its typed passwords are redacted, by the declaration alone."""
    from gatewayd.analysis import rate
    from gatewayd.analysis.offline import language_of
    from gatewayd.analysis.providers import describe_input
    from gatewayd.guardrails import GuardRailService, check_language
    from gatewayd.models import GuardRail, new_id
    from gatewayd.store import open_store

    store = await open_store(load_config(None, environ={}, overrides={"data_dir": str(tmp_path)}))
    try:
        org = (await store.default_org()).id
        connection = Connection(id=new_id(), org_id=org, name="fake", resource_name="fake", type="database",
                                subtype="fakesql")
        rail = GuardRail(id=new_id(), org_id=org, name="rail", connection_ids=[connection.id], input={"rules": [
            {"type": "deny_words_list", "words": ["drop table"]},
            {"type": "require_where", "statements": ["delete"]}]}, output={"rules": []})
        await store.save_guardrail(rail, create=True)
        rules = await GuardRailService(store).rules_for(connection)
        assert not rules.check_input("drop/**/table t").allowed  # a SQL comment: shell rules would let it pass
        assert "delete without WHERE" in rules.check_input("delete from t").message
    finally:
        await store.close()
    assert check_language(rail.input, rail.output, language_of("fakesql")) is None
    assert "reads SQL statements" in (check_language(rail.input, rail.output, language_of("ssh")) or "")
    assert rate("ALTER USER app SUPERUSER; DROP DATABASE shop", language_of("fakesql")).risk_level == "high"
    message = describe_input("ALTER ROLE app PASSWORD 'hunter2-secret'", "database", "fakesql", 1000)
    assert "hunter2-secret" not in message and "the input is fake SQL" in message


@pytest.fixture
def line_protocol():
    protocols.register(LINE)  # the one registration line
    try:
        yield LINE
    finally:
        protocols.unregister("line")


def test_the_proxies_are_registered_under_the_api_contract_names():
    described = {(d.name, d.subtype, d.prefix, d.server_config_key, d.session_type) for d in protocols.registered()}
    assert described == {("postgres", "postgres", "pg", "postgres_server_config", "database"),
                         ("ssh", "ssh", "ssh", "ssh_server_config", "custom"),
                         ("rdp", "rdp", "rdp", "rdp_server_config", "custom"),
                         ("mysql", "mysql", "my", "mysql_server_config", "database"),
                         ("http", "httpproxy", "httpproxy", "http_proxy_server_config", "httpproxy")}
    assert protocols.by_prefix("httpproxy") is protocols.by_subtype("httpproxy") is protocols.by_name("http")


def test_a_clashing_registration_is_refused(line_protocol):
    protocols.register(LINE)  # the same description again: a no-op
    with pytest.raises(ValueError, match="prefix 'pg'"):
        protocols.register(protocols.ProtocolDescription(
            name="other", subtype="other", session_type="custom", prefix="pg", server_config_key="other_config",
            default_port=1, access_hints=_hints, start=_start))
    with pytest.raises(ValueError, match="without '-'"):
        protocols.register(protocols.ProtocolDescription(
            name="dash", subtype="dash", session_type="custom", prefix="da-sh", server_config_key="dash_config",
            default_port=1, access_hints=_hints, start=_start))


def test_config_accepts_a_registered_protocols_section_and_validates_it(line_protocol, tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[listeners]\nline = "127.0.0.1:7000"\n[line]\ngreeting = "hi"\n')
    config = load_config(path, environ={"GATEWAYD_LINE_MAX_LINES": "3"})
    assert (config["listeners.line"], config["line.greeting"], config["line.max_lines"]) == ("127.0.0.1:7000", "hi", 3)
    assert load_config(None, environ={})["listeners.line"] == "127.0.0.1:17777"  # its default port
    with pytest.raises(ConfigError, match="line.max_lines: must be positive"):
        load_config(None, environ={}, overrides={"line.max_lines": 0})
    with pytest.raises(ConfigError, match="line.colour: unknown setting"):
        load_config(None, environ={}, overrides={"line.colour": "red"})


def test_without_its_registration_the_section_is_unknown(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[line]\ngreeting = "hi"\n')
    with pytest.raises(ConfigError, match="line.greeting: unknown setting"):
        load_config(path, environ={})


async def test_a_registered_protocol_is_listed_started_and_its_credentials_resolve(line_protocol, tmp_path):
    address = f"127.0.0.1:{free_port()}"
    config = load_config(None, environ={}, overrides={
        "data_dir": str(tmp_path / "data"), "api.listen": f"127.0.0.1:{free_port()}", "listeners.postgres": "",
        "listeners.ssh": "", "listeners.rdp": "", "listeners.http": "", "listeners.mysql": "", "listeners.line": address,
        "line.greeting": "hi there"})
    gateway = build_gateway(config)  # the composition root, as `gatewayd run` builds it
    await gateway.start()
    try:
        admin = await gateway.identity.ensure_local_user("admin@example.com", "Admin", ["admin"])
        headers = {"Authorization": f"Bearer {gateway.identity.issue_token(admin)}"}
        base = f"http://{config['api.listen']}/api"
        async with aiohttp.ClientSession(headers=headers) as http:
            async with http.get(f"{base}/serverconfig/misc") as response:
                document = await response.json()
            assert document["line_server_config"] == {"listen_address": address}
            async with http.get(f"{base}/serverinfo") as response:
                assert (await response.json())["listeners"]["line"]["status"] == "running"

            async with http.post(f"{base}/connections", json={
                    "name": "lines", "type": "custom", "subtype": "line",
                    "secret": {"envvar:HOST": base64.b64encode(b"127.0.0.1").decode()}}) as response:
                assert response.status == 201
            async with http.post(f"{base}/connections/lines/credentials", json={}) as response:
                assert response.status == 201
                issued = await response.json()
            secret = issued["connection_credentials"]["command"].split("'")[1].split("\\n")[0]
            assert secret.startswith("line-") and looks_like_secret(secret)
            port = address.rsplit(":", 1)[1]
            assert issued["connection_credentials"]["command"].endswith(f"\\nhi there\\n' | nc 127.0.0.1 {port}")

            reader, writer = await asyncio.open_connection("127.0.0.1", int(port))
            writer.write(f"{secret}\nhello\n".encode())
            assert (await reader.readline()).decode() == f"session {issued['session_id']}\n"
            assert await reader.readline() == b"echo: hello\n"
            writer.close()

            moved = f"127.0.0.1:{free_port()}"
            async with http.put(f"{base}/serverconfig/misc",
                                json={"line_server_config": {"listen_address": moved}}) as response:
                assert response.status == 200, await response.text()
            assert gateway.listeners.summary()["line"] == {"listen_address": moved, "status": "running", "error": ""}
            reader, writer = await asyncio.open_connection(*moved.rsplit(":", 1))
            writer.write(b"line-" + b"x" * 43 + b"\n")
            assert (await reader.readline()).startswith(b"denied: invalid credential")
            writer.close()
        for _ in range(100):
            session = await gateway.store.get_session(issued["session_id"])
            if session.status == "done":
                break
            await asyncio.sleep(0.05)
        assert (session.type, session.subtype) == ("custom", "line")
    finally:
        await gateway.stop()


async def test_the_api_serves_each_protocols_presentation_from_its_description(fake_sql, line_protocol, tmp_path):
    """GET /api/protocols: what the CLI and the console read instead of naming protocols. A protocol registered
    here (a fake SQL one, the line one) is listed with what its description says or implies: SQL statements
    are shown and exported as statements (csv, json), anything else as text; the built-in ones with theirs."""
    config = load_config(None, environ={}, overrides={
        "data_dir": str(tmp_path / "data"), "api.listen": f"127.0.0.1:{free_port()}", "listeners.postgres": "",
        "listeners.ssh": "", "listeners.rdp": "", "listeners.http": "", "listeners.mysql": "", "listeners.line": "",
        "listeners.fakesql": ""})
    gateway = build_gateway(config)
    await gateway.start()
    try:
        admin = await gateway.identity.ensure_local_user("admin@example.com", "Admin", ["admin"])
        base = f"http://{config['api.listen']}/api"
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{base}/protocols") as response:
                assert response.status == 401  # a signed-in user's route
            async with http.get(f"{base}/protocols",
                                headers={"Authorization": f"Bearer {gateway.identity.issue_token(admin)}"}) as response:
                assert response.status == 200
                listed = await response.json()
            async with http.get(f"{base}/openapi.json") as response:
                document = await response.json()
        ResponseSchemas(document).check("GET", "/api/protocols", 200, listed)  # as the OpenAPI document says
        by_subtype = {entry["subtype"]: entry for entry in listed}
        assert list(by_subtype) == [d.subtype for d in protocols.registered()]
        assert by_subtype["fakesql"] == {
            "name": "fakesql", "subtype": "fakesql", "session_type": "database", "title": "fakesql",
            "language": {"name": "fakesql", "family": "sql", "title": "fake SQL", "dialect": "postgresql"},
            "presentation": "statements", "exports": ["csv", "json", "text"], "client": None}
        assert (by_subtype["line"]["presentation"], by_subtype["line"]["exports"]) == ("text", ["text"])
        shown = {subtype: (entry["title"], entry["presentation"], entry["exports"])
                 for subtype, entry in by_subtype.items() if subtype not in ("fakesql", "line")}
        assert shown == {"postgres": ("PostgreSQL", "statements", ["csv", "json", "text"]),
                         "mysql": ("MySQL", "statements", ["csv", "json", "text"]),
                         "ssh": ("SSH", "terminal", ["asciicast", "text"]),
                         "rdp": ("RDP", "frames", ["png-frames", "text"]),
                         "httpproxy": ("HTTP", "exchanges", ["text"])}
        assert by_subtype["postgres"]["client"]["programs"] == ["psql"]
        assert ("PGPASSWORD", "{password}") in by_subtype["postgres"]["client"]["env"].items()
        assert by_subtype["mysql"]["client"]["programs"] == ["mysql", "mariadb"]
        assert by_subtype["ssh"]["client"]["options_with_value"]  # ssh(1): options before the destination
        assert by_subtype["httpproxy"]["client"] is None  # the browser
    finally:
        await gateway.stop()


def test_a_presentation_is_one_the_viewers_know():
    with pytest.raises(ValueError, match="presentation 'hologram'"):
        protocols.ProtocolDescription(name="odd", subtype="odd", session_type="custom", prefix="odd",
                                      server_config_key="odd_server_config", default_port=17779,
                                      access_hints=_hints, start=_start, presentation="hologram")


def test_a_subtype_no_protocol_serves_has_no_native_access():
    conn = Connection(id="c", org_id="o", name="n", resource_name="n", type="custom", subtype="line")
    with pytest.raises(ValueError, match="has no native access"):
        credential_prefix(conn)


def test_rdp_without_its_extra_still_describes_itself(monkeypatch, caplog):
    """Its settings load and its hints render; only its listener is left out, the log naming what is missing."""
    import importlib.util

    import proxies

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pyrdp" else real(name, *a))
    rdp = protocols.by_name("rdp")
    assert rdp is not None and not rdp.available() and rdp.missing_modules() == ["pyrdp"]
    config = load_config(None, environ={}, overrides={"rdp.record_keyboard": True})
    assert config.section("rdp") == {"record_keyboard": True, "frames_cap_bytes": 1024 ** 3, "frames_dir": "",
                                     "startup_timeout": 20.0}
    conn = Connection(id="c", org_id="o", name="desk", resource_name="desk", type="custom", subtype="rdp")
    assert rdp.access_hints(conn, "rdp-s", "gw", 13389, config.section("rdp"))["command"] == \
        "xfreerdp /v:gw:13389 /u:rdp-s /p:rdp-s"
    with caplog.at_level("WARNING", logger="gatewayd.rdp"):
        assert "rdp" not in proxies.available_listeners()
    assert "pyrdp" in caplog.records[-1].missing
