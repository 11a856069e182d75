"""Two web apps open at once in one real browser (Debian's Chromium driven by Playwright) through the HTTP proxy.

Each connection's app has its own origin (``<label>.<http.apps_domain>``,
``*.localhost`` by default, which Chromium resolves to loopback itself), so
its cookie and its pages stay its own: a tab keeps reaching the app it
opened, whatever another tab opens. With ``http.apps_domain`` empty (one
shared origin) the second app is refused with a page saying why instead of
taking the first one's cookie. Two real target apps (``tests/httppeer.py``)
tell by what they received which one a request reached.
"""

from __future__ import annotations

import json
import os
import uuid

import aiohttp
import pytest

from tests.apiclient import admin_http
from tests.conftest import proxy_daemon
from tests.test_http_proxy import HttpApi, start_target

CHROMIUM = "/usr/bin/chromium"
APPS_TEST = "apps.test"  # a wildcard domain of our own, as an operator would set up: apps under it are one site
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run",
                 "--no-proxy-server", f"--host-resolver-rules=MAP *.{APPS_TEST} 127.0.0.1"]


@pytest.fixture(scope="module")
def targets():
    """Two target apps, "A" and "B", each in its own process: {name: url}."""
    started = {name: start_target() for name in ("A", "B")}
    try:
        yield {name: f"http://127.0.0.1:{port}" for name, (_, port) in started.items()}
    finally:
        for process, _ in started.values():
            process.terminate()
            process.wait(10)


def _gateway(tmp_path_factory, name: str, settings: dict):
    daemon = proxy_daemon(tmp_path_factory, name, "http", settings, wait=True)
    daemon.http_url = f"http://127.0.0.1:{daemon.proxy_port}"
    return daemon


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    """A gateway on the defaults: each connection's app on its own ``*.localhost`` origin."""
    daemon = _gateway(tmp_path_factory, "httpbrowser", {})
    yield daemon
    assert daemon.stop() == 0


@pytest.fixture(scope="module")
def shared_gateway(tmp_path_factory):
    """A gateway with ``http.apps_domain`` empty: every app on the listener's one origin."""
    daemon = _gateway(tmp_path_factory, "httpshared", {"http.apps_domain": ""})
    yield daemon
    assert daemon.stop() == 0


@pytest.fixture(scope="module")
def site_gateway(tmp_path_factory):
    """A gateway whose apps live under a real-looking wildcard domain (``*.apps.test``): one site for them all."""
    daemon = _gateway(tmp_path_factory, "httpsite", {"http.apps_domain": APPS_TEST})
    yield daemon
    assert daemon.stop() == 0


@pytest.fixture(scope="module")
async def browser():
    if not os.path.exists(CHROMIUM):
        message = f"{CHROMIUM} is not installed (Debian package chromium): run scripts/install-peers.sh"
        if os.geteuid() == 0:
            pytest.fail(message)
        pytest.skip(message)
    from playwright.async_api import async_playwright

    async with async_playwright() as playwright:
        launched = await playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield launched
        finally:
            await launched.close()


async def seen(target: str, marker: str) -> list[str]:
    """The paths holding ``marker`` that the target app received."""
    async with aiohttp.ClientSession() as http, http.get(f"{target}/seen") as response:
        return [path for path in await response.json() if marker in path]


async def open_app(context, url: str):
    page = await context.new_page()
    response = await page.goto(url)
    return page, response


async def fetch_and_post(page, marker: str) -> tuple[dict, dict]:
    """From ``page``: a fetch of ``/echo/fetched-<marker>``, then the page's form posted with ``marker``."""
    fetched = await page.evaluate("path => fetch(path).then(r => r.json())", f"/echo/fetched-{marker}")
    await page.fill("input[name=note]", marker)
    async with page.expect_navigation():
        await page.click("button[type=submit]")
    posted = json.loads(await page.inner_text("body"))
    return fetched, posted


async def test_two_apps_in_two_tabs_each_reach_their_own(gateway, targets, browser):
    async with admin_http(gateway) as http:
        api = HttpApi(gateway, http, targets["A"])
        first = await api.access(await api.role(targets["A"]))
        second = await api.access(await api.role(targets["B"]))
    assert first["origin"] != second["origin"]
    context = await browser.new_context()
    try:
        # A from the link the API gave; B from the listener's shared address (an older link): both land on
        # their own origin, the secret gone from the address bar
        tab_a, response = await open_app(context, f"{first['url']}page")
        assert response.status == 200 and tab_a.url == f"{first['origin']}/page"
        tab_b, response = await open_app(context, f"{gateway.http_url}/{second['proxy_token']}/page")
        assert response.status == 200 and tab_b.url == f"{second['origin']}/page"
        cookies = {c["domain"]: c for c in await context.cookies() if c["name"] == "gatewayd_proxy_token"}
        assert set(cookies) == {first["origin"].split("//")[1].split(":")[0],
                                second["origin"].split("//")[1].split(":")[0]}
        assert all(c["httpOnly"] and c["sameSite"] == "Lax" for c in cookies.values())

        # back in tab A, after B opened: a fetch and a form post both reach A, never B
        await tab_a.bring_to_front()
        marker = uuid.uuid4().hex
        fetched, posted = await fetch_and_post(tab_a, marker)
        assert fetched["path"] == f"/echo/fetched-{marker}"
        assert posted["method"] == "POST" and posted["path"] == "/echo/posted" and posted["body"] == f"note={marker}"
        assert await seen(targets["A"], marker) == [f"/echo/fetched-{marker}"]
        assert await seen(targets["B"], marker) == []
        async with aiohttp.ClientSession() as client, client.get(f"{targets['B']}/seen") as answer:
            assert "/echo/posted" not in await answer.json()
        # and tab B still reaches B
        other = uuid.uuid4().hex
        fetched = await tab_b.evaluate("path => fetch(path).then(r => r.json())", f"/echo/fetched-{other}")
        assert fetched["path"] == f"/echo/fetched-{other}"
        assert await seen(targets["B"], other) == [f"/echo/fetched-{other}"] and await seen(targets["A"], other) == []
    finally:
        await context.close()


async def test_a_page_of_one_app_cannot_send_to_another_on_the_same_site(site_gateway, targets, browser):
    """Apps under one domain are one site, so a SameSite=Lax cookie would go along: the gateway refuses."""
    async with admin_http(site_gateway) as http:
        api = HttpApi(site_gateway, http, targets["A"])
        first = await api.access(await api.role(targets["A"]))
        second = await api.access(await api.role(targets["B"]))
    assert first["origin"].split("//")[1].split(":")[0].endswith(f".{APPS_TEST}")
    context = await browser.new_context()
    try:
        tab_a, response = await open_app(context, f"{first['url']}page")
        assert response.status == 200 and tab_a.url == f"{first['origin']}/page"
        tab_b, response = await open_app(context, f"{second['url']}page")
        assert response.status == 200 and tab_b.url == f"{second['origin']}/page"

        await tab_a.bring_to_front()
        marker = uuid.uuid4().hex
        # A's page posts a form to B's address and fires a request at it: B never sees either
        await tab_a.evaluate("""async ([origin, marker]) => {
            await fetch(origin + "/echo/fetched-" + marker, {method: "POST", mode: "no-cors", credentials: "include"});
            const form = document.querySelector("form");
            form.action = origin + "/echo/posted-" + marker;
            form.querySelector("input").value = marker;
        }""", [second["origin"], marker])
        async with tab_a.expect_navigation():
            await tab_a.click("button[type=submit]")
        assert tab_a.url == f"{second['origin']}/echo/posted-{marker}"
        assert await seen(targets["B"], marker) == [] and await seen(targets["A"], marker) == []
        assert "Refused: a request from another app" in await tab_a.inner_text("body")

        # A's own requests still reach A, B's tab still reaches B
        await tab_a.go_back()
        fetched, posted = await fetch_and_post(tab_a, marker)
        assert fetched["path"] == f"/echo/fetched-{marker}" and posted["body"] == f"note={marker}"
        assert await seen(targets["A"], marker) == [f"/echo/fetched-{marker}"]
        assert await seen(targets["B"], marker) == []
        fetched = await tab_b.evaluate("path => fetch(path).then(r => r.json())", f"/echo/fetched-{marker}")
        assert await seen(targets["B"], marker) == [f"/echo/fetched-{marker}"]
    finally:
        await context.close()


async def test_on_one_shared_origin_a_second_app_is_refused_with_a_page(shared_gateway, targets, browser):
    async with admin_http(shared_gateway) as http:
        api = HttpApi(shared_gateway, http, targets["A"])
        first_role, second_role = await api.role(targets["A"]), await api.role(targets["B"])
        first, second = await api.access(first_role), await api.access(second_role)
    assert first["origin"] == second["origin"] == shared_gateway.http_url
    context = await browser.new_context()
    try:
        tab_a, response = await open_app(context, f"{first['url']}page")
        assert response.status == 200 and tab_a.url == f"{shared_gateway.http_url}/page"
        tab_b, response = await open_app(context, f"{second['url']}page")
        assert response.status == 409
        text = await tab_b.inner_text("body")
        assert "Another app is open here" in text and first_role["name"] in text and second_role["name"] in text
        assert "http.apps_domain" in text and second["proxy_token"] not in await tab_b.content()

        await tab_a.bring_to_front()
        marker = uuid.uuid4().hex
        fetched, posted = await fetch_and_post(tab_a, marker)
        assert fetched["path"] == f"/echo/fetched-{marker}" and posted["body"] == f"note={marker}"
        assert await seen(targets["A"], marker) == [f"/echo/fetched-{marker}"]
        assert await seen(targets["B"], marker) == []
    finally:
        await context.close()


async def test_on_one_shared_origin_a_cookie_whose_access_ended_is_simply_replaced(shared_gateway, targets):
    async with admin_http(shared_gateway) as http:
        api = HttpApi(shared_gateway, http, targets["A"])
        first = await api.access(await api.role(targets["A"]), seconds=2)
        second = await api.access(await api.role(targets["B"]))
        held = {"Cookie": f"gatewayd_proxy_token={first['proxy_token']}"}
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as client:
            opening = f"{second['url']}page"
            async with client.get(opening, headers=held, allow_redirects=False) as response:
                assert response.status == 409 and "Set-Cookie" not in response.headers
                assert "is open in this browser" in (await response.json())["message"]
            await api.session(first["session_id"], lambda s: s["status"] == "done", timeout=15)
            async with client.get(opening, headers=held, allow_redirects=False) as response:
                assert response.status == 302 and response.headers["Location"] == "/page"
                assert second["proxy_token"] in response.headers["Set-Cookie"]
