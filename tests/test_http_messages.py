"""Unit tests of the HTTP proxy's pure logic: credentials, headers, cookies, redirects, recording text."""

from __future__ import annotations

import gzip

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxies.http import messages as m

SECRET = "httpproxy-" + "a" * 43
OTHER = "httpproxy-" + "B" * 43


def test_credential_from_header_bare_or_bearer():
    assert m.extract_credential(SECRET, None, "/x") == m.PresentedCredential(SECRET, "header")
    assert m.extract_credential(f"Bearer {SECRET}", None, "/x") == m.PresentedCredential(SECRET, "header")
    assert m.extract_credential(f"bearer   {SECRET} ", None, "/x") == m.PresentedCredential(SECRET, "header")


def test_the_targets_own_authorization_is_not_a_credential():
    assert m.extract_credential("Basic dXNlcjpwdw==", None, "/x") is None
    assert m.extract_credential("Bearer eyJhbGciOi.x.y", f"gatewayd_proxy_token={SECRET}", "/x") == \
        m.PresentedCredential(SECRET, "cookie")
    assert m.extract_credential("Bearer pg-" + "a" * 43, None, "/x") is None  # not an http credential


def test_credential_from_cookie_among_others():
    cookie = f"a=1; gatewayd_proxy_token={SECRET}; b=2"
    assert m.extract_credential(None, cookie, "/x") == m.PresentedCredential(SECRET, "cookie")
    assert m.extract_credential(None, "gatewayd_proxy_tokenx=1", "/x") is None
    assert m.extract_credential(None, "gatewayd_proxy_token=", "/x") is None


@pytest.mark.parametrize(("path", "rest"), [
    (f"/{SECRET}", "/"), (f"/{SECRET}/", "/"), (f"/{SECRET}/app/page?q=1", "/app/page?q=1"),
    (f"/{SECRET}?a=/b", "/?a=/b"), (f"/{SECRET}//evil.example/x", "/evil.example/x"),
    (f"/{SECRET}/\\evil.example", "/evil.example"),
])
def test_credential_from_first_path_segment(path, rest):
    assert m.extract_credential(None, None, path) == m.PresentedCredential(SECRET, "path", rest)


def test_the_path_form_wins_so_a_secret_in_a_url_is_never_forwarded():
    found = m.extract_credential(OTHER, f"gatewayd_proxy_token={OTHER}", f"/{SECRET}/x")
    assert found == m.PresentedCredential(SECRET, "path", "/x")
    assert m.extract_credential(None, None, "/httpproxy-short/x") is None


def test_credential_cookie_attributes():
    cookie = m.credential_cookie(SECRET, 600, secure=False)  # plain http: a Secure cookie would be dropped
    assert cookie == f"gatewayd_proxy_token={SECRET}; Path=/; Max-Age=600; HttpOnly; SameSite=Lax"
    assert "Max-Age=0" in m.credential_cookie(SECRET, -5, secure=False)
    secure = m.credential_cookie(SECRET, 600, secure=True)  # over https: never sent over plain http
    assert secure == f"gatewayd_proxy_token={SECRET}; Path=/; Max-Age=600; HttpOnly; SameSite=Lax; Secure"


def test_upstream_headers_drop_hop_by_hop_and_the_gateway_credential():
    headers = [("Host", "gw:18888"), ("Authorization", SECRET), ("Connection", "keep-alive, X-Private"),
               ("X-Private", "1"), ("Keep-Alive", "timeout=5"), ("Transfer-Encoding", "chunked"),
               ("Content-Length", "5"), ("Expect", "100-continue"), ("TE", "trailers"), ("Upgrade", "h2c"),
               ("Proxy-Authorization", "Basic x"), ("Cookie", f"gatewayd_proxy_token={SECRET}"),
               ("Accept", "*/*"), ("X-Forwarded-For", "10.0.0.1"), ("X-Forwarded-For", "10.0.0.2")]
    out = m.upstream_request_headers(headers, "header", "127.0.0.9", "http", "gw:18888")
    assert out == [("Accept", "*/*"), ("X-Forwarded-For", "10.0.0.1, 10.0.0.2, 127.0.0.9"),
                   ("X-Forwarded-Proto", "http"), ("X-Forwarded-Host", "gw:18888")]


def test_upstream_headers_keep_the_targets_authorization_when_the_credential_came_by_cookie():
    headers = [("Authorization", "Basic abc"), ("Cookie", f"a=1; gatewayd_proxy_token={SECRET}; b=2")]
    out = m.upstream_request_headers(headers, "cookie", "1.2.3.4", "http", "")
    assert out == [("Authorization", "Basic abc"), ("Cookie", "a=1; b=2"), ("X-Forwarded-For", "1.2.3.4"),
                   ("X-Forwarded-Proto", "http")]


TARGET = m.TargetUrl.parse("http://app.internal:8080")
BASED = m.TargetUrl.parse("https://app.internal/base/")


def test_target_url_parsing():
    assert TARGET.origin == "http://app.internal:8080" and TARGET.base_path == ""
    assert BASED.origin == "https://app.internal" and BASED.base_path == "/base" and BASED.port == 443
    assert BASED.url_for("/x?y=1") == "https://app.internal/base/x?y=1"
    assert m.TargetUrl.parse("http://u:p@h:1/").where == "h:1"
    for bad in ("", "ftp://h/", "http:///x", "h:80"):
        with pytest.raises(ValueError):
            m.TargetUrl.parse(bad)


@pytest.mark.parametrize(("location", "target", "expected"), [
    ("http://app.internal:8080/login?next=/a", TARGET, "http://gw:18888/login?next=/a"),
    ("HTTP://APP.INTERNAL:8080/", TARGET, "http://gw:18888/"),
    ("http://app.internal:9090/x", TARGET, "http://app.internal:9090/x"),  # another port: another place
    ("https://elsewhere.example/x", TARGET, "https://elsewhere.example/x"),
    ("/relative?x=1", TARGET, "/relative?x=1"),
    ("relative", TARGET, "relative"),
    ("//app.internal:8080/p", TARGET, "http://gw:18888/p"),
    ("https://app.internal/base/in#frag", BASED, "http://gw:18888/in#frag"),
    ("https://app.internal/base", BASED, "http://gw:18888/"),
    ("/base/in?q", BASED, "/in?q"),
    ("/outside", BASED, "/outside"),
])
def test_redirects_are_rewritten_to_the_gateway(location, target, expected):
    assert m.rewrite_location(location, target, "http://gw:18888") == expected


def test_response_headers():
    headers = [("Content-Length", "3"), ("Transfer-Encoding", "chunked"), ("Connection", "close, X-Hop"),
               ("X-Hop", "1"), ("Location", "http://app.internal:8080/next"), ("Set-Cookie", "s=1; HttpOnly"),
               ("Content-Encoding", "gzip")]
    assert m.downstream_response_headers(headers, TARGET, "http://gw") == [
        ("Location", "http://gw/next"), ("Set-Cookie", "s=1; HttpOnly"), ("Content-Encoding", "gzip")]


@pytest.mark.parametrize(("content_type", "text"), [
    ("text/html; charset=utf-8", True), ("application/json", True), ("application/vnd.api+json", True),
    ("application/x-www-form-urlencoded", True), ("application/xml", True), ("image/svg+xml", False),
    ("application/octet-stream", False), ("image/png", False), (None, False), ("", False),
    ("application/jsonp-but-not", False),
])
def test_text_content_types(content_type, text):
    assert m.is_text(content_type) is text


def test_websocket_upgrade_detection():
    assert m.is_websocket_upgrade([("Connection", "keep-alive, Upgrade"), ("Upgrade", "websocket")])
    assert not m.is_websocket_upgrade([("Upgrade", "websocket")])
    assert not m.is_websocket_upgrade([("Connection", "Upgrade"), ("Upgrade", "h2c")])


def test_recorded_heads_never_hold_a_secret():
    head = m.head_text(f"GET /x?t={SECRET} HTTP/1.1", [
        ("Authorization", SECRET), ("Authorization", "Bearer abc.def"),
        ("Cookie", f"a=1; gatewayd_proxy_token={SECRET}"),
        ("Set-Cookie", "sid=xyz; Path=/; HttpOnly"), ("Referer", f"http://gw/{SECRET}/"), ("X-Api-Key", "k"),
        ("Accept", "*/*")])
    assert SECRET not in head and "abc.def" not in head and "xyz" not in head
    assert head == ("GET /x?t=[REDACTED] HTTP/1.1\r\nAuthorization: [REDACTED]\r\nAuthorization: Bearer [REDACTED]\r\n"
                    "Cookie: a=[REDACTED]; gatewayd_proxy_token=[REDACTED]\r\n"
                    "Set-Cookie: sid=[REDACTED]; Path=/; HttpOnly\r\nReferer: http://gw/[REDACTED]/\r\n"
                    "X-Api-Key: [REDACTED]\r\nAccept: */*\r\n\r\n")


def test_body_notes():
    assert m.body_note(10, 10, True) == ""
    assert m.body_note(10, None, True) == ""
    assert m.body_note(4096, 10_000, True) == "\r\n[body: 4096 of 10000 bytes recorded]"
    assert m.body_note(4096, None, False) == "\r\n[body: 4096 of a size not known yet (streamed) recorded]"


def test_guard_text_reads_line_headers_and_body():
    text = m.guard_text("POST /q HTTP/1.1", [("X-A", "b")], b'{"sql": "drop table"}')
    assert text == 'POST /q HTTP/1.1\r\nX-A: b\r\n\r\n{"sql": "drop table"}'


@given(st.text(), st.text(), st.text())
def test_extract_credential_never_raises(authorization, cookie, path):
    found = m.extract_credential(authorization, cookie, "/" + path)
    assert found is None or found.secret


@given(st.text(min_size=1))
def test_rewrite_location_never_raises(location):
    assert isinstance(m.rewrite_location(location, TARGET, "http://gw"), str)


@pytest.mark.parametrize(("path", "climbs"), [
    ("/../x", True), ("/a/..", True), ("/%2e%2e/x", True), ("/a/%2E%2E", True), ("/a\\..\\b", True),
    ("/a..b/", False), ("/x?q=/../", False), ("/.../x", False), ("/plain", False), ("/a;b=1/c", False),
    ("/a/./b", True), ("/..;/x", True), ("/%2e%2e;/x", True), ("/%252e%252e/x", True), ("/..%00/x", True),
    ("/.%2e/x", True), ("/a/.;x=1/b", True), ("/x%00", True), ("/%25252e%25252e/x", True),
])
def test_dot_segments(path, climbs):
    assert m.has_dot_segments(path) is climbs


def test_request_head():
    head = m.request_head("POST", BASED, "/x?y=1", [("Accept", "*/*"), ("X-Raw", "caf\udcc3\udca9")], chunked=True)
    assert head == (b"POST /base/x?y=1 HTTP/1.1\r\nHost: app.internal\r\nAccept: */*\r\nX-Raw: caf\xc3\xa9\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n")
    assert m.request_head("GET", TARGET, "/", []) == b"GET / HTTP/1.1\r\nHost: app.internal:8080\r\n\r\n"


def test_scrub_finds_secrets_ending_in_punctuation():
    secret = "httpproxy-" + "x" * 42 + "-"
    assert m.scrub(f"Referer: http://gw/{secret}/page") == "Referer: http://gw/[REDACTED]/page"
    assert m.scrub(f"?t={secret}") == "?t=[REDACTED]"


@pytest.mark.parametrize(("link", "expected"), [
    ("<http://app.internal:8080/style.css>; rel=preload; as=style", "<http://gw/style.css>; rel=preload; as=style"),
    ('<http://app.internal:8080/a>; rel="next", </b?x=1>; rel=prev, <https://cdn.example/c.js>; rel=preload',
     '<http://gw/a>; rel="next", </b?x=1>; rel=prev, <https://cdn.example/c.js>; rel=preload'),
    ('<http://app.internal:8080/x,y>;rel=a,<//app.internal:8080/z>;rel=b', "<http://gw/x,y>;rel=a,<http://gw/z>;rel=b"),
    ('<relative>; title="see <http://app.internal:8080/q>, \\"quoted\\""',
     '<relative>; title="see <http://app.internal:8080/q>, \\"quoted\\""'),  # inside a quoted string: text
    ("no brackets at all", "no brackets at all"),
    # datasette's form: the URI without its brackets (issue 31, item 10)
    ('http://app.internal:8080/db.json; rel="alternate"; type="application/json+datasette"',
     'http://gw/db.json; rel="alternate"; type="application/json+datasette"'),
    ("</a>; rel=x, http://app.internal:8080/b; rel=y, https://cdn.example/c; rel=z",
     "</a>; rel=x, http://gw/b; rel=y, https://cdn.example/c; rel=z"),
    ("<http://app.internal:8080/unterminated", "<http://app.internal:8080/unterminated"),
])
def test_link_headers_are_rewritten_to_the_gateway(link, expected):
    assert m.rewrite_link(link, TARGET, "http://gw") == expected


def test_link_under_a_base_path_and_in_response_headers():
    assert m.rewrite_link("</base/api>; rel=api, </other>; rel=x, <https://app.internal/base>; rel=home",
                          BASED, "http://gw") == "</api>; rel=api, </other>; rel=x, <http://gw/>; rel=home"
    headers = [("Link", "<http://app.internal:8080/a>; rel=preload"), ("link", "</b>; rel=next")]
    assert m.downstream_response_headers(headers, TARGET, "http://gw") == [
        ("Link", "<http://gw/a>; rel=preload"), ("link", "</b>; rel=next")]


def test_no_response_header_names_the_targets_origin():
    headers = [("Refresh", "5; url=http://app.internal:8080/next"), ("Access-Control-Allow-Origin",
               "HTTP://APP.INTERNAL:8080"), ("X-Debug", "from http://app.internal:8080/x, not http://app.internal:80801/"),
               ("X-Elsewhere", "http://app.internal.example/ http://app.internal:9090/")]
    assert m.downstream_response_headers(headers, TARGET, "http://gw") == [
        ("Refresh", "5; url=http://gw/next"), ("Access-Control-Allow-Origin", "http://gw"),
        ("X-Debug", "from http://gw/x, not http://app.internal:80801/"),
        ("X-Elsewhere", "http://app.internal.example/ http://app.internal:9090/")]


@given(st.text())
def test_rewrite_link_never_raises_and_keeps_links_elsewhere(value):
    assert isinstance(m.rewrite_link(value, TARGET, "http://gw"), str)
    if "app.internal" not in value.lower() and "/base" not in value:
        assert m.rewrite_link(value, BASED, "http://gw") == value


@pytest.mark.parametrize(("host", "label"), [
    ("grafana-1a2b3c4d.localhost:18888", "grafana-1a2b3c4d"), ("GRAFANA-1A2B3C4D.LocalHost", "grafana-1a2b3c4d"),
    ("x.localhost.:80", "x"), ("a.b.localhost", "a.b"), ("localhost:18888", None), ("127.0.0.1:18888", None),
    ("evil-localhost", None), (".localhost", None), ("[::1]:18888", None), ("", None),
])
def test_app_host_labels(host, label):
    assert m.app_host_label(host, "localhost") == label
    assert m.app_host_label(host, "") is None


def test_app_origins_keep_the_port_the_request_came_to():
    assert m.app_origin("a-1", "apps.example.com", "http", "gw.example.com:18888") == \
        "http://a-1.apps.example.com:18888"
    assert m.app_origin("a-1", "localhost", "https", "gw") == "https://a-1.localhost"
    assert m.app_origin("a-1", "localhost", "http", "[::1]:8080") == "http://a-1.localhost:8080"
    assert m.split_host("[::1]") == ("[::1]", "") and m.split_host("H:1") == ("h", ":1")
    assert m.app_origin("a-1", "localhost", "http", "gw:80@evil.example/x") == "http://a-1.localhost"
    assert m.split_host("[::1]x") == ("[::1]", "") and m.split_host("gw:") == ("gw", "")


def test_connection_app_labels_are_dns_labels_unique_per_connection():
    from gatewayd.models import Connection

    def label(name: str, id: str = "3F2A9C1D-0000-4000-8000-000000000000") -> str:
        return Connection(id=id, org_id="o", name=name, resource_name=name, type="httpproxy",
                          subtype="httpproxy").app_label

    assert label("Grafana") == "grafana-3f2a9c1d"
    assert label("my_app (prod)") == "my-app-prod-3f2a9c1d"
    assert label("日本") == "3f2a9c1d"
    assert len(label("x" * 200)) <= 63
    assert label("grafana") != label("grafana", "77aa0011-0000-4000-8000-000000000000")


def test_refusal_pages_escape_what_they_show():
    page = m.refusal_page(403, 'connection "<b>"', "http://a.localhost/?x=<y>", "Wrong address for this app")
    assert "<title>Wrong address for this app</title>" in page
    assert "connection &quot;&lt;b&gt;&quot;" in page and 'href="http://a.localhost/?x=&lt;y&gt;"' in page
    assert m.wants_html("text/html,application/xhtml+xml;q=0.9") and not m.wants_html("application/json")
    assert not m.wants_html(None)


def test_links_to_other_hosts_are_left_exactly_as_written():
    assert m.rewrite_location("//cdn.example/x", TARGET, "http://gw") == "//cdn.example/x"
    assert m.rewrite_link("<//cdn.example/x>; rel=preload", TARGET, "http://gw") == "<//cdn.example/x>; rel=preload"


@given(st.text(), st.sampled_from(["localhost", "apps.example.com", ""]))
def test_app_hosts_never_raise_and_stay_under_the_domain(host, domain):
    label = m.app_host_label(host, domain)
    assert label is None or (domain and label and m.split_host(host)[0].rstrip(".").endswith(f"{label}.{domain}"))
    origin = m.app_origin("a-1", domain or "localhost", "http", host)
    assert origin.startswith(f"http://a-1.{domain or 'localhost'}") and "/" not in origin[7:]


@pytest.mark.parametrize(("method", "origin", "site", "mode", "refused"), [
    ("POST", "http://b-2.apps.test:8080", None, None, True),  # a form of app B posted to app A
    ("GET", "http://b-2.apps.test", "same-site", "cors", True),  # B's script fetching from A
    ("GET", None, "same-site", "no-cors", True),  # B's <img> or <script> pointing at A
    ("POST", None, "same-site", "navigate", True),
    ("GET", None, "same-site", "navigate", False),  # a link in B followed: lands in A's own tab
    ("POST", "http://a-1.apps.test:8080", "same-origin", "navigate", False),  # A's own form
    ("GET", None, "same-origin", "cors", False), ("GET", None, None, None, False),  # curl, an old browser
    ("POST", "null", None, None, False), ("POST", "http://gw.example.com", None, None, False),
    ("POST", "http://a-1.apps.test", "cross-site", "navigate", False),  # Lax keeps the cookie home anyway
])
def test_requests_from_another_apps_pages(method, origin, site, mode, refused):
    assert m.from_another_app("a-1", "apps.test", method, origin, site, mode) is refused


def test_guard_readings_decode_what_the_target_decodes():
    assert m.guard_readings("GET /plain?a=b HTTP/1.1", [("X", "y")]) == ("GET /plain?a=b HTTP/1.1\r\nX: y", None)
    text, readings = m.guard_readings("GET /%61dmin/x?q=drop+table%2520x HTTP/1.1", [])
    assert readings == (text, "GET /admin/x?q=drop table x HTTP/1.1")
    form = "application/x-www-form-urlencoded"
    assert m.body_readings(form, "", b"q=drop+table%20x", True, 100) == ("q=drop+table%20x", "q=drop table x")
    assert m.body_readings("application/json", "", b'{"q": "drop\\u0020table\\\\u0020"}', True, 100)[1] == (
        '{"q": "drop table\\u0020"}')  # an escaped backslash stays one
    assert m.body_readings("text/plain; charset=ISO-8859-1", "gzip", gzip.compress("caf\xe9".encode("latin-1")),
                           True, 100) == ("caf\xe9", "caf\xe9")
    with pytest.raises(m.Unreadable):
        m.body_readings("text/plain", "gzip", gzip.compress(b"x")[:-4], False, 100)
    assert m.unreadable_body("POST", ["application/json; charset=utf-16"], []) == "a body in charset 'utf-16'"
    assert m.unreadable_body("POST", ["text/plain"], ["gzip", "gzip"]) == "a body in Content-Encoding 'gzip, gzip'"
    assert m.unreadable_body("POST", ["text/plain"], ["deflate"]) is None


def test_no_gateway_secret_is_sent_on():
    secret = "httpproxy-" + "a" * 43
    assert m.without_secrets(f"/x?t={secret}&k=1") == "/x?k=1"
    assert m.without_secrets(f"/x?t={secret}") == "/x"
    out = m.upstream_request_headers([("Referer", f"http://gw/{secret}"), ("Cookie", f"a=1; b={secret}"),
                                      ("X-Kept", "1")], "cookie", "1.2.3.4", "http", "")
    assert ("X-Kept", "1") in out and ("Cookie", "a=1") in out and secret not in str(out)


def test_a_charset_is_read_the_same_on_both_sides_quoted_either_way():
    """One reading of ``charset``: a request's rules and a response's masks agree; an empty one is read by neither
    (refused, withheld), never taken for UTF-8."""
    assert m.body_codec("text/plain; charset='utf-16'", b"x\x00") == "utf-16"
    assert m.body_codec('text/plain; charset="UTF-8"', b"x") == "utf-8"
    assert m.body_codec("text/plain; charset=", b"x") is None
    assert m.unreadable_body("POST", ["text/plain; charset='utf-8'"], []) is None
    assert m.unreadable_body("POST", ["text/plain; charset="], []) == "a body in charset ''"
