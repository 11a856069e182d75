"""How the daemon serves the web console's files, without a browser: the page, its policy, and the page that
says how to build the console when its player is missing (the daemon still runs)."""

from __future__ import annotations

from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from control import console


@pytest.fixture
async def client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    static = tmp_path / "console_static"
    static.mkdir()
    (static / "index.html").write_text("<!doctype html><title>console</title>")
    (static / "app.js").write_text("export {};")
    (tmp_path / "secret.js").write_text("the daemon must not serve this")
    monkeypatch.setattr(console, "STATIC", static)
    app = web.Application()
    console.add_console(app)
    async with TestClient(TestServer(app)) as test_client:
        test_client.static = static
        yield test_client


async def test_without_the_player_the_page_says_how_to_build_it(client):
    response = await client.get("/")
    assert response.status == 503
    text = await response.text()
    assert "make console" in text and "vendor" in text
    assert response.headers["Content-Security-Policy"].startswith("default-src 'self'")

    vendor = client.static / "vendor"
    vendor.mkdir()
    for name in console.VENDOR_FILES:
        (vendor / name).write_text("/* player */")
    response = await client.get("/")  # built while the daemon runs: served at once
    assert response.status == 200 and "<title>console</title>" in await response.text()
    for header, value in console.SECURITY_HEADERS.items():
        assert response.headers[header] == value


async def test_only_known_files_inside_the_folder_are_served(client):
    response = await client.get("/console/app.js")
    assert response.status == 200 and response.headers["Content-Type"] == "text/javascript; charset=utf-8"
    assert response.headers["X-Content-Type-Options"] == "nosniff"
    for path in ("/console/../secret.js", "/console/%2E%2E/secret.js", "/console/nothing.js", "/console/"):
        assert (await client.get(path)).status == 404, path
