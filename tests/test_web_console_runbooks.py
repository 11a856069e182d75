"""The web console's runbooks and reports in a real browser (Debian's Chromium through Playwright): a person lists
the runbooks of a real git repository (tests/gitpeer.py), fills a runbook's form, runs it on a real PostgreSQL,
sees its review (opened from the link a Slack message carries) and its result; an auditor reads the reports.
"""

from __future__ import annotations

from typing import Any, AsyncIterator

import aiohttp
import pytest

from tests.apiclient import Api, postgres_env
from tests.conftest import Daemon
from tests.gitpeer import GitServer
from tests.test_web_console import PASSWORDS, Screen, _unavailable, browser  # noqa: F401 (the browser fixture)

pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=_unavailable() or "")

RUNBOOK = """SELECT {{ .customer | description "whose orders" | required "say whose" | pattern "^[a-z]+$" | squote }}
  AS customer, {{ .region | options "eu" "us" | default "eu" | squote }} AS region,
  {{ .count | type "number" | default "3" }} * 2 AS doubled;
"""


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    daemon = Daemon(tmp_path_factory.mktemp("consolerb") / "data", {"sessions.exec_wait": "20s"}).start()
    for email, groups in (("ada@example.com", "admin,dba"), ("rita@example.com", "dev")):
        daemon.cli("user", "passwd", "--email", email, "--groups", groups, "--password-stdin",
                   input=PASSWORDS[email] + "\n")
    daemon.base = daemon.url.removesuffix("/api")
    yield daemon
    assert daemon.stop() == 0


@pytest.fixture(scope="module")
async def world(gateway, pg_target, tmp_path_factory) -> AsyncIterator[dict[str, Any]]:
    git = GitServer(tmp_path_factory.mktemp("consolegit")).start()
    tree = git.repository("team")
    commit = git.commit(tree, {"sql/orders.runbook.sql": RUNBOOK})
    async with aiohttp.ClientSession() as http:
        ada = Api(gateway, http, gateway.token("ada@example.com", groups="admin,dba"))
        status, body = await ada("PUT", "/runbooks/configurations", {"repositories": [{"git_url": git.url("team")}]})
        assert status == 200, body
        plain = await ada.connection("pgplain", "database", "postgres", postgres_env(pg_target))
        reviewed = await ada.connection("pgreviewed", "database", "postgres", postgres_env(pg_target),
                                        {"reviewers": ["dba"]})
        yield {"commit": commit, "repository": body["repositories"][0]["repository"], "plain": plain,
               "reviewed": reviewed, "ada": ada}
    git.stop()


@pytest.fixture
async def screen(browser, gateway, tmp_path) -> AsyncIterator[Screen]:  # noqa: F811
    context = await browser.new_context(viewport={"width": 1280, "height": 900})
    yield Screen(await context.new_page(), gateway, tmp_path)
    await context.close()


async def test_a_person_fills_a_runbooks_form_and_reads_its_result(world, screen):
    await screen.sign_in("rita@example.com")
    await screen.page.click("nav a[href='#/runbooks']")
    row = screen.page.locator("tr[data-runbook='sql/orders.runbook.sql']")
    await row.wait_for()
    await screen.shot("runbooks-list")
    await row.locator("button.open-runbook").click()
    await screen.page.wait_for_selector("#runbook-form")
    assert await screen.page.locator("[data-parameter=region] option").all_inner_texts() == ["—", "eu", "us"]
    assert await screen.page.locator("[data-parameter=count]").get_attribute("type") == "number"
    await screen.page.select_option("#runbook-connection", world["plain"]["name"])
    await screen.page.fill("[data-parameter=customer]", "NOT valid")
    await screen.page.click("#run-runbook")
    refused = screen.page.locator("#runbook-outcome .notice.error")
    await refused.wait_for()
    assert "does not match the pattern" in await refused.inner_text()
    await screen.page.fill("[data-parameter=customer]", "acme")
    await screen.page.fill("[data-parameter=count]", "21")
    await screen.page.click("#run-runbook")
    await screen.page.wait_for_selector("#runbook-result")
    assert await screen.page.inner_text("#exit-code") == "0"
    output = await screen.page.inner_text("#runbook-output")
    assert "acme" in output and "42" in output, output
    await screen.shot("runbook-result")
    await screen.page.click("#result-session")
    await screen.page.wait_for_selector("text=acme")
    screen.assert_clean_log(allowed=("422",))


async def test_a_reviewed_runbook_is_approved_from_its_link_then_run(world, screen, browser, gateway, tmp_path):
    await screen.sign_in("rita@example.com")
    await screen.open(f"#/runbooks/run?repository={world['repository']}&name=sql/orders.runbook.sql")
    await screen.page.wait_for_selector("#runbook-form")
    await screen.page.select_option("#runbook-connection", world["reviewed"]["name"])
    await screen.page.fill("[data-parameter=customer]", "globex")
    await screen.page.click("#run-runbook")
    await screen.page.wait_for_selector("#runbook-review")
    review_id = (await screen.page.get_attribute("#review-link", "href")).rsplit("=", 1)[1]
    await screen.page.click("#run-approved")
    await screen.page.wait_for_selector("text=it runs once approved")

    context = await browser.new_context(viewport={"width": 1280, "height": 900})
    try:
        reviewer = Screen(await context.new_page(), gateway, tmp_path)
        await reviewer.sign_in("ada@example.com")
        await reviewer.open(f"?review={review_id}")  # the link a Slack review request carries
        card = reviewer.page.locator(f"article[data-review='{review_id}']")
        await card.wait_for()
        assert "globex" in await card.locator("pre.script").inner_text()
        await card.locator("button.approve").click()
        await card.locator(".notice.ok").wait_for()
        await reviewer.shot("review-from-link")
        reviewer.assert_clean_log()
    finally:
        await context.close()

    await screen.page.click("#run-approved")
    await screen.page.wait_for_selector("#runbook-result")
    assert "globex" in await screen.page.inner_text("#runbook-output")
    screen.assert_clean_log()


async def test_an_auditor_reads_the_reports(world, screen, gateway):
    token = gateway.token("audrey@example.com", groups="auditor")
    await screen.use_token(token)
    await screen.page.click("nav a[href='#/reports']")
    table = screen.page.locator("#report")
    await table.wait_for()
    await screen.page.select_option("#report-filters select[name=group_by]", "user")
    await screen.page.click("#report-filters button[type=submit]")
    await screen.page.wait_for_selector("#report tr[data-resource='rita@example.com']")
    assert int(await screen.page.inner_text("#report tfoot td.number >> nth=0")) >= 2
    await screen.shot("reports")
    screen.assert_clean_log()


async def test_an_admin_switches_features_makes_the_key_and_adds_a_webhook(world, screen):
    await screen.sign_in("ada@example.com")
    await screen.page.click("nav a[href='#/settings']")
    row = screen.page.locator("#features tr[data-feature='runbooks']")
    await row.wait_for()
    await row.locator("button.toggle-feature").click()
    await screen.page.wait_for_selector("#features tr[data-feature='runbooks'] .badge.rejected")
    status, features = await world["ada"]("GET", "/orgs/features")
    assert {f["name"]: f["status"] for f in features}["runbooks"] == "disabled"
    await screen.page.locator("#features tr[data-feature='runbooks'] button.toggle-feature").click()
    await screen.page.wait_for_selector("#features tr[data-feature='runbooks'] .badge.approved")

    await screen.page.click("#make-org-key")
    key = (await screen.page.inner_text("#new-org-key")).strip()
    assert key.startswith("xorg-")
    status, me = await world["ada"]("GET", "/userinfo", token=key)
    assert status == 200 and me["subject"].startswith("gatewayd:org-key:")

    await screen.page.click("#toggle-webhooks")
    await screen.page.wait_for_selector("#webhooks-plugin.approved")
    await screen.page.fill("#add-endpoint input[name=url]", "https://127.0.0.1:9/hook")
    await screen.page.check("#add-endpoint input[value='review.create']")
    await screen.page.click("#add-endpoint button[type=submit]")
    assert (await screen.page.inner_text("#endpoint-secret")).startswith("whsec_")
    status, endpoints = await world["ada"]("GET", "/webhooks/endpoints")
    assert [(e["url"], e["event_types"]) for e in endpoints] == [("https://127.0.0.1:9/hook", ["review.create"])]
    await screen.shot("settings")
    await screen.page.reload()
    await screen.page.click("#send-ping")
    await screen.page.wait_for_selector("#deliveries tr[data-delivery]")
    screen.assert_clean_log(allowed=("404",))  # GET /orgs/keys before there is a key: the page says "No key."
