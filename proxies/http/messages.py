"""HTTP proxy logic without sockets: credentials, header rewriting, redirects, recording text.

Everything here is a pure function of its arguments (header lists in, header
lists or strings out), so each rule is a unit test; ``server.py`` does the I/O.
"""

from __future__ import annotations

import codecs
import functools
import html
import re
import zlib
from dataclasses import dataclass
from typing import Iterable
from urllib.parse import unquote, unquote_plus, urlsplit

from multidict import MultiMapping

COOKIE_NAME = "gatewayd_proxy_token"
REDACTED = "[REDACTED]"

# RFC 9110 7.6.1 hop-by-hop fields, plus the de-facto ones proxies drop too.
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te",
    "trailer", "transfer-encoding", "upgrade",
})
# Never sent to the target: recomputed by the gateway, or the gateway's own.
_REQUEST_DROP = HOP_BY_HOP | {"host", "content-length", "expect", "x-forwarded-for", "x-forwarded-proto",
                              "x-forwarded-host"}
_RESPONSE_DROP = HOP_BY_HOP | {"content-length"}
_SECRET_HEADERS = frozenset({"authorization", "proxy-authorization", "cookie", "set-cookie", "x-api-key",
                             "x-auth-token", "x-csrf-token", "x-xsrf-token"})
_TEXT_TYPES = re.compile(r"^\s*(?:text/|application/(?:[\w.+-]*\+)?(?:json|xml|javascript|x-www-form-urlencoded|"
                         r"graphql|x-ndjson|yaml|x-yaml|sql)\b)", re.I)
_JSON_TYPE = re.compile(r"^\s*(?:application|text)/(?:[\w.+-]*\+)?(?:x-)?(?:nd)?json(?:l|-seq|lines)?\s*(?:;|$)",
                        re.I)
# Response bodies output rules and masks leave alone: known binary types only (``is_binary``)
_BINARY_TYPE = re.compile(
    r"^\s*(?:image/(?!svg)|audio/|video/|font/|application/(?:octet-stream|pdf|zip|gzip|x-gzip|x-tar|x-bzip2?|"
    r"x-xz|zstd|x-7z-compressed|x-rar-compressed|vnd\.rar|java-archive|wasm|x-shockwave-flash|vnd\.ms-fontobject|"
    r"font-|x-font-|x-protobuf|protobuf|grpc|x-msdownload|x-sqlite3|vnd\.android\.package-archive)\b)", re.I)
# a Content-Type's charset, quoted either way or not; an empty one is caught too (read by nobody: refused, withheld)
_CHARSET = re.compile(r";\s*charset\s*=\s*[\"']?([^\s;\"']*)", re.I)
# In a Link header: a quoted parameter (kept), a <target URI>, or a target written without its brackets at the
# start of an entry (datasette's ``Link: http://127.0.0.1:8001/db.json; rel="alternate"``, off RFC 8288 but sent).
_LINK_PART = re.compile(r'"(?:[^"\\]|\\.)*"?|<([^>]*)>|(?:^|(?<=,))(\s*)([A-Za-z][A-Za-z0-9+.-]*://[^\s;,]+|/[^\s;,]*)')
_REFRESH_URL = re.compile(r"(\burl\s*=\s*['\"]?)([^'\"\s;]+)", re.I)  # Refresh: 5; url=http://target/...
_FORM_TYPE = re.compile(r"^\s*application/x-www-form-urlencoded\s*(?:;|$)", re.I)
_FORM_DATA_TYPE = re.compile(r"^\s*multipart/form-data\s*(?:;|$)", re.I)
_TEXT_PART_TYPE = re.compile(r"^\s*text/", re.I)  # with JSON, the file parts of a form the rules read
_PART_CODINGS = frozenset({"", "7bit", "8bit", "binary", "identity"})  # a part's bytes as they are
# the charsets of a request body the rules decode (the target's reading of ASCII is the same in all of them)
_BODY_CODECS = {"utf-8": "utf-8", "utf8": "utf-8", "us-ascii": "utf-8", "ascii": "utf-8",
                "iso-8859-1": "latin-1", "latin1": "latin-1", "latin-1": "latin-1"}
_JSON_ESCAPE = re.compile(r'\\(?:u([0-9a-fA-F]{4})|(["\\/bfnrt]))')
_JSON_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_BODILESS_METHODS = frozenset({"GET", "HEAD", "DELETE", "OPTIONS", "TRACE"})  # a body on these: refused under rules
_DECODE_ROUNDS = 8  # a path percent-decoded more times than this without settling is refused
_SECRET_TEXT = re.compile(r"httpproxy-[A-Za-z0-9_-]{43}")  # no \b: a secret may end in "-" or "_"
_SECRET_BYTES = re.compile(_SECRET_TEXT.pattern.encode())

Headers = list[tuple[str, str]]


class CredentialSource:
    """Where the request carried the gateway credential."""

    HEADER = "header"
    COOKIE = "cookie"
    PATH = "path"


@dataclass(slots=True, frozen=True)
class PresentedCredential:
    """The secret a request presented, where it came from, and (for the path form) the rest of the path."""

    secret: str
    source: str
    rest_path: str = ""


@dataclass(slots=True, frozen=True)
class AnswerHead:
    """The target's status and headers as the client gets them (under a mask rule, masked) and as recorded,
    and the text output rules read of them ("" when there are none)."""

    headers: Headers
    reason: str
    recorded: bytes
    checked: str


def _cookie_value(cookie_header: str, name: str) -> str | None:
    for part in cookie_header.split(";"):
        key, sep, value = part.strip().partition("=")
        if sep and key.strip() == name:
            return value.strip().strip('"')
    return None


def extract_credential(authorization: str | None, cookie_header: str | None, path: str) -> PresentedCredential | None:
    """The gateway credential of a request, looked for in this order: first path segment, header, cookie.

    The path form comes first so a secret in a URL is never forwarded to the
    target (a browser holding the cookie that opens the link again is simply
    redirected again); it returns the rest of the path (always starting with
    ``/``) for the redirect. ``Authorization`` counts only when its value (bare
    or after ``Bearer``) has the shape of an ``httpproxy-`` secret; any other
    value is the target's own and is passed on.
    """
    if path.startswith("/httpproxy-"):
        path_only, question, query = path.partition("?")
        segment, _, rest = path_only[1:].partition("/")
        if _is_proxy_secret(segment):  # "//host" would make the redirect leave the gateway: one slash
            return PresentedCredential(segment, CredentialSource.PATH, "/" + rest.lstrip("/\\") + question + query)
    if authorization:
        value = authorization.strip()
        if value[:7].lower() == "bearer ":
            value = value[7:].strip()
        if _is_proxy_secret(value):
            return PresentedCredential(value, CredentialSource.HEADER)
    if cookie_header and COOKIE_NAME in cookie_header:
        value = _cookie_value(cookie_header, COOKIE_NAME)
        if value:
            return PresentedCredential(value, CredentialSource.COOKIE)
    return None


def _is_proxy_secret(value: str) -> bool:
    return len(value) == 53 and value.startswith("httpproxy-")


def credential_cookie(secret: str, max_age: int, secure: bool) -> str:
    """The ``Set-Cookie`` value that lets a browser carry the credential: HttpOnly, SameSite=Lax, path /; ``Secure``
    when the client reached the gateway over https (a browser sends it over https only, so that no plain http
    request to the same host gives the credential away), never on plain http (a browser would drop it)."""
    return (f"{COOKIE_NAME}={secret}; Path=/; Max-Age={max(max_age, 0)}; HttpOnly; SameSite=Lax"
            + ("; Secure" if secure else ""))


def strip_credential_cookie(cookie_header: str) -> str:
    """The ``Cookie`` header without the gateway's cookie (empty when nothing else is left)."""
    kept = [part.strip() for part in cookie_header.split(";")
            if part.strip() and part.strip().partition("=")[0].strip() != COOKIE_NAME]
    return "; ".join(kept)


def _lowered(headers: Iterable[tuple[str, str]],
             drop: frozenset[str]) -> tuple[list[tuple[str, str, str]], frozenset[str]]:
    """Each header with its lowered name, and ``drop`` plus the names listed in ``Connection`` (hop-by-hop
    for this message only)."""
    rows = [(name.lower(), name, value) for name, value in headers]
    for lower, _, value in rows:
        if lower == "connection":
            drop = drop | frozenset(t.strip().lower() for t in value.split(",") if t.strip())
    return rows, drop


def upstream_request_headers(headers: Iterable[tuple[str, str]], source: str | None, client_ip: str,
                             proto: str, host: str) -> Headers:
    """The headers sent to the target: hop-by-hop and the gateway's credential removed, X-Forwarded-* added.

    The target's own ``Authorization`` passes when the credential came by
    cookie or path; ``X-Forwarded-For`` extends the client's list. Any other
    header that holds a gateway credential (a ``Referer`` with one in its
    URL) is dropped, a cookie that holds one too.
    """
    rows, drop = _lowered(headers, _REQUEST_DROP)
    out: Headers = []
    forwarded_for = ""
    for lower, name, value in rows:
        if lower == "x-forwarded-for":
            forwarded_for = f"{forwarded_for}, {value}" if forwarded_for else value
            continue
        if lower in drop:
            continue
        if lower == "authorization" and source == CredentialSource.HEADER:
            continue
        if lower == "cookie" and COOKIE_NAME in value:
            value = strip_credential_cookie(value)
            if not value:
                continue
        if "httpproxy-" in value and _SECRET_TEXT.search(value):  # a gateway credential: the target has no use
            if lower != "cookie":  # for it (a Referer, a header of the app's own): the header goes
                continue
            value = "; ".join(part.strip() for part in value.split(";") if not _SECRET_TEXT.search(part))
            if not value:
                continue
        out.append((name, value))
    out.append(("X-Forwarded-For", f"{forwarded_for}, {client_ip}" if forwarded_for else client_ip))
    out.append(("X-Forwarded-Proto", proto))
    if host:
        out.append(("X-Forwarded-Host", host))
    return out


def downstream_response_headers(headers: Iterable[tuple[str, str]], target: "TargetUrl",
                                 gateway_origin: str) -> Headers:
    """The target's response headers for the client: hop-by-hop dropped, redirects kept on the gateway, and the
    target's own origin (``scheme://host:port``, its address) in no header: a link to it is one to the gateway."""
    rows, drop = _lowered(headers, _RESPONSE_DROP)
    out: Headers = []
    for lower, name, value in rows:
        if lower in drop:
            continue
        if lower == "location" or lower == "content-location":
            value = rewrite_location(value, target, gateway_origin)
        elif lower == "link":
            value = rewrite_link(value, target, gateway_origin)
        elif lower == "refresh":
            value = _REFRESH_URL.sub(lambda found: found[1] + rewrite_location(found[2], target, gateway_origin),
                                     value)
        out.append((name, target.without_origin(value, gateway_origin)))
    return out


@dataclass(slots=True, frozen=True)
class TargetUrl:
    """The role's ``REMOTE_URL`` split once: origin (scheme://host:port) and base path."""

    scheme: str
    host: str
    port: int
    base_path: str  # "" or "/prefix" without a trailing slash

    @classmethod
    def parse(cls, remote_url: str) -> "TargetUrl":
        parts = urlsplit(remote_url.strip())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("REMOTE_URL must be an http:// or https:// URL with a host")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return cls(parts.scheme, parts.hostname, port, parts.path.rstrip("/"))

    @property
    def origin(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = (self.scheme == "http" and self.port == 80) or (self.scheme == "https" and self.port == 443)
        return f"{self.scheme}://{host}" if default else f"{self.scheme}://{host}:{self.port}"

    def without_origin(self, text: str, gateway_origin: str) -> str:
        """``text`` with the target's origin, written either way (with or without its default port), in any case,
        replaced by ``gateway_origin``: a header the gateway does not know still shows no target address."""
        lowered = text.lower()
        if self.host.lower() not in lowered:
            return text
        host = f"[{self.host}]" if ":" in self.host else self.host
        for origin in sorted({self.origin, f"{self.scheme}://{host}:{self.port}"}, key=len, reverse=True):
            text = re.sub(re.escape(origin) + r"(?![\w.:-])", lambda _: gateway_origin, text, flags=re.I)
        return text

    @property
    def host_header(self) -> str:
        """The ``Host`` the target expects: its host, with the port unless it is the scheme's default."""
        return self.origin.split("://", 1)[1]

    @property
    def where(self) -> str:
        """Host and port, for messages (never the URL's user info)."""
        return f"{self.host}:{self.port}"

    def url_for(self, path_qs: str) -> str:
        """The target URL of a gateway path (with its query string)."""
        return self.origin + self.base_path + path_qs

    def gateway_path(self, path: str) -> str | None:
        """The gateway path of a target path, or None when it is outside the base path."""
        if not self.base_path:
            return path or "/"
        if path == self.base_path:
            return "/"
        if path.startswith(self.base_path + "/"):
            return path[len(self.base_path):]
        return None


def without_secrets(path_qs: str) -> str:
    """A request target as sent on: each query parameter that holds a gateway credential dropped (the target
    has no use for it, and would echo it in its pages and errors)."""
    if "httpproxy-" not in path_qs:
        return path_qs
    path, question, query = path_qs.partition("?")
    kept = "&".join(part for part in query.split("&") if not _SECRET_TEXT.search(part))
    return path + ("?" + kept if kept else "")


def request_head(method: str, target: TargetUrl, path_qs: str, headers: Iterable[tuple[str, str]],
                 chunked: bool = False) -> bytes:
    """The HTTP/1.1 request line and headers sent to the target (header bytes restored as the client sent them;
    no gateway credential in the query)."""
    lines = [f"{method} {target.base_path}{without_secrets(path_qs)} HTTP/1.1", f"Host: {target.host_header}"]
    lines += [f"{name}: {value}" for name, value in headers]
    if chunked:
        lines.append("Transfer-Encoding: chunked")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape")


def target_form_refusal(method: str, raw_path: str) -> tuple[int, str] | None:
    """The status and reason for a request target the gateway does not forward, or None for a path.

    The target is always the connection's: a ``CONNECT`` (a tunnel), the absolute form a forward proxy is
    sent (``GET http://other-host/x``: a target would route it by that host, past rules read on the path) and
    the asterisk form (``OPTIONS *``) are refused rather than rewritten.
    """
    if method == "CONNECT":
        return 405, "CONNECT is refused: the gateway opens no tunnels, it forwards requests to the connection's target"
    if raw_path.startswith("/"):
        return None
    if raw_path == "*":
        return 400, "the asterisk-form request target (OPTIONS *) is refused: send a path"
    return 400, ("an absolute-form request target (a URL with a scheme and host) is refused: send the path alone, "
                 "the target is the connection's")


def has_dot_segments(raw_path: str) -> bool:
    """Whether a path has a ``.`` or ``..`` segment that could climb out of the target's base path once the
    target normalizes it, read every way a server on the way may: percent-decoded again until nothing changes
    (``%252e``), backslashes as slashes, path parameters cut (``..;``, Tomcat's and Jetty's reading); a NUL
    anywhere counts too (``..%00``)."""
    path = raw_path.partition("?")[0]
    if "." not in path and "%" not in path:
        return False
    for _ in range(_DECODE_ROUNDS):
        decoded = unquote(path)
        if decoded == path:
            break
        path = decoded
    else:
        return True  # still encoded after that many rounds: nothing reads it so, refused
    if "\x00" in path:
        return True
    return any(segment.partition(";")[0] in (".", "..") for segment in path.replace("\\", "/").split("/"))


def rewrite_location(location: str, target: TargetUrl, gateway_origin: str) -> str:
    """A ``Location`` pointing at the target, turned into the same place on the gateway.

    Absolute URLs to the target's origin become the gateway origin, paths
    under the base path lose it; other hosts are left alone (an external
    redirect is the target's choice).
    """
    parts = urlsplit(f"{target.scheme}:{location}" if location.startswith("//") else location)
    if parts.scheme or parts.netloc:
        try:
            same = (parts.scheme == target.scheme and (parts.hostname or "").lower() == target.host.lower()
                    and (parts.port or (443 if parts.scheme == "https" else 80)) == target.port)
        except ValueError:
            return location
        if not same:
            return location  # as the target wrote it (a scheme-relative one stays so)
        path = target.gateway_path(parts.path) or parts.path or "/"
        rest = path + (f"?{parts.query}" if parts.query else "") + (f"#{parts.fragment}" if parts.fragment else "")
        return gateway_origin + rest
    if location.startswith("/"):
        path, sep, rest = location.partition("?")
        mapped = target.gateway_path(path)
        if mapped is not None:
            return mapped + (sep + rest if sep else "")
    return location


def rewrite_link(value: str, target: TargetUrl, gateway_origin: str) -> str:
    """A ``Link`` header (RFC 8288: ``<uri>; rel=...`` entries, comma-separated) with each ``<uri>`` turned
    into the same place on the gateway as ``rewrite_location`` does; parameters pass unchanged, quoted
    strings included (a ``<`` inside one is not a URI). An entry that starts with a bare URI (no brackets,
    as datasette writes them) is rewritten the same way."""
    def one(found: re.Match[str]) -> str:
        if found[1] is not None:
            return f"<{rewrite_location(found[1], target, gateway_origin)}>"
        if found[3] is not None:
            return found[2] + rewrite_location(found[3], target, gateway_origin)
        return found[0]

    return _LINK_PART.sub(one, value)


def split_host(host: str) -> tuple[str, str]:
    """A ``Host`` value as (name lowered, ``:port`` or ""); an IPv6 literal keeps its brackets, a port that is
    not digits is dropped (a redirect never leaves for a place the ``Host`` smuggled in)."""
    host = host.strip().lower()
    if host.startswith("["):
        name, _, rest = host.partition("]")
        name, sep, port = name + "]", rest[:1], rest[1:]
    else:
        name, sep, port = host.rpartition(":")
        if not sep:
            return host, ""
    return name, f":{port}" if sep == ":" and port.isdigit() and port.isascii() else ""


def app_host_label(host: str, apps_domain: str) -> str | None:
    """The label of an app origin's ``Host`` (``<label>.<apps_domain>``, any port), else None.

    Every name under the domain is an app host: a deeper one gives a label
    no connection has (refused), never the shared address.
    """
    if not apps_domain:
        return None
    name = split_host(host)[0].rstrip(".")
    suffix = "." + apps_domain
    if len(name) > len(suffix) and name.endswith(suffix):
        return name[:-len(suffix)]
    return None


def app_origin(label: str, apps_domain: str, scheme: str, host: str) -> str:
    """The origin of a connection's app host, on the port of the ``Host`` the request came to."""
    return f"{scheme}://{label}.{apps_domain}{split_host(host)[1]}"


def from_another_app(label: str, apps_domain: str, method: str, origin: str | None, fetch_site: str | None,
                     fetch_mode: str | None) -> bool:
    """Whether a browser sent this request to app ``label`` from another app's page.

    App hosts under one domain are one *site*, so ``SameSite=Lax`` lets a
    page of one app send (forms, scripts, images) to another with that one's
    cookie. Such a request names the other app in ``Origin`` (every POST and
    cross-origin fetch), or says ``Sec-Fetch-Site: same-site`` (browsers send
    it to https and localhost); only a plain link followed (a GET navigation)
    passes, and it lands in the other app's own tab.
    """
    if origin and origin != "null":
        sender = app_host_label(urlsplit(origin).netloc, apps_domain) if "://" in origin else None
        if sender is not None and sender != label:
            return True
    if fetch_site is not None and fetch_site.strip().lower() == "same-site":
        return not (fetch_mode == "navigate" and method in ("GET", "HEAD"))
    return False


def wants_html(accept: str | None) -> bool:
    """Whether the client is a browser loading a page (its ``Accept`` names ``text/html``)."""
    return accept is not None and "text/html" in accept.lower()


def refusal_page(status: int, message: str, link: str | None = None, title: str | None = None) -> str:
    """The gateway's own answer for a browser: a small HTML page saying why (``link``: where to go instead)."""
    title = html.escape(title or {401: "Access needed", 409: "Another app is open here"}.get(
        status, "Refused by the gateway"))
    go = f'\n<p><a href="{html.escape(link)}">{html.escape(link)}</a></p>' if link else ""
    return (f'<!doctype html>\n<html><head><meta charset="utf-8"><title>{title}</title></head>\n'
            f"<body><h1>{title}</h1>\n<p>{html.escape(message)}</p>{go}\n"
            f"<p><small>gatewayd HTTP proxy, status {status}</small></p></body></html>\n")


def is_text(content_type: str | None) -> bool:
    """Whether a body of this content type is text the guard rails read (JSON, XML, forms, text/*)."""
    return bool(content_type) and _TEXT_TYPES.match(content_type) is not None  # type: ignore[arg-type]


def unreadable_body(method: str, content_types: list[str], content_encodings: list[str]) -> str | None:
    """Why input rules cannot read a request body sent with these headers as the target will (the words of the
    refusal), or None. A body on a method whose body servers commonly do not read is refused outright: such a
    server takes it for the next request on the connection, which no rule read as one."""
    if method in _BODILESS_METHODS:
        return f"a body on a {method} request (a target that does not read it would take it for the next request)"
    if not content_types:
        return "a body without a Content-Type"
    if len(content_types) > 1:
        return "a body with several Content-Type headers"
    if not is_text(content_types[0]) and not is_form_data(content_types[0]):
        return f"a body of type {content_types[0].strip()[:60]!r}, which the rules do not read as text"
    coding = ", ".join(content_encodings).strip().lower()
    if coding not in ("", "identity", "gzip", "x-gzip", "deflate"):
        return f"a body in Content-Encoding {coding[:40]!r}"
    charset = _CHARSET.search(content_types[0])
    if charset is not None and charset[1].lower() not in _BODY_CODECS:
        return f"a body in charset {charset[1][:40]!r}"
    return None


class Unreadable(ValueError):
    """A body the rules or masks must read that the gateway cannot, ``str()`` says why: a request's the input
    rules cannot read after all (``body_readings``: refused), a response's the output rules or masks cannot (a
    content coding it has no decoder for, a charset Python does not know, JSON a rule by key cannot place its keys
    in: withheld)."""


def body_readings(content_type: str, content_encoding: str, body: bytes, complete: bool,
                  limit: int) -> tuple[str, str]:
    """What input rules read of a request body ``unreadable_body`` let through (at most ``limit`` bytes of it):
    the text as sent (its content coding undone, its charset decoded) and as the target decodes it (a form's
    percent-escapes and ``+``, a JSON document's string escapes such as ``\\u0020``).

    Raises Unreadable for a compressed body that is not whole within ``limit`` or does not decode.
    """
    coding = content_encoding.strip().lower()
    if coding not in ("", "identity"):
        if not complete:
            raise Unreadable(f"a body in Content-Encoding {coding!r} longer than http.guard_body_bytes")
        decoded = decoded_body(body, [coding], limit)
        if decoded is None or not decoded[1]:
            raise Unreadable(f"a body in Content-Encoding {coding!r} that does not decode within "
                             f"http.guard_body_bytes")
        body = decoded[0]
    charset = _CHARSET.search(content_type)
    text = body[:limit].decode(_BODY_CODECS[charset[1].lower()] if charset is not None else "utf-8", "replace")
    if _FORM_TYPE.match(content_type):
        return text, _settled(unquote_plus(text))
    if is_json(content_type) and "\\" in text:
        return text, _JSON_ESCAPE.sub(lambda found: chr(int(found[1], 16)) if found[1] else
                                      _JSON_ESCAPES[found[2]], text)
    return text, text


def is_form_data(content_type: str | None) -> bool:
    """Whether a request body of this content type is a form's ``multipart/form-data``."""
    return bool(content_type) and _FORM_DATA_TYPE.match(content_type) is not None  # type: ignore[arg-type]


def form_part_reading(headers: MultiMapping[str], data: bytes, limit: int) -> str:
    """What input rules read of one part of a ``multipart/form-data`` body as the target decodes it: a text field
    (no type: ``text/plain``) or a file of type ``text/*`` or JSON, in UTF-8, read as such a body is
    (``body_readings``). Raises Unreadable for a part the rules cannot read (a binary file, another charset, a
    transfer encoding, several types)."""
    types = headers.getall("Content-Type", [])
    if len(types) > 1:
        raise Unreadable("a multipart/form-data part with several Content-Type headers")
    part_type = types[0] if types else "text/plain"  # RFC 7578: a part without a type is text/plain
    if _TEXT_PART_TYPE.match(part_type) is None and not is_json(part_type):
        raise Unreadable(f"a multipart/form-data part of type {part_type.strip()[:60]!r}, which the rules do not "
                         f"read as text")
    for name in ("Content-Transfer-Encoding", "Content-Encoding"):
        coding = ", ".join(headers.getall(name, [])).strip().lower()
        if coding not in _PART_CODINGS:
            raise Unreadable(f"a multipart/form-data part in {name} {coding[:40]!r}")
    charset = _CHARSET.search(part_type)
    if charset is not None and _BODY_CODECS.get(charset[1].lower()) != "utf-8":
        raise Unreadable(f"a multipart/form-data part in charset {charset[1][:40]!r}")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        raise Unreadable("a multipart/form-data part that is not UTF-8 text") from None
    return body_readings(part_type, "", data, True, limit)[1]


def _settled(text: str) -> str:
    """``text`` percent-decoded again until nothing changes (at most ``_DECODE_ROUNDS`` times)."""
    for _ in range(_DECODE_ROUNDS):
        if "%" not in text:
            break
        decoded = unquote(text)
        if decoded == text:
            break
        text = decoded
    return text


def decoded_line(first_line: str) -> str:
    """A request line as the target reads its target: the path percent-decoded, the query too with ``+`` as a
    space (each again until nothing changes: a server on the way may decode once more)."""
    method, _, rest = first_line.partition(" ")
    target, _, version = rest.rpartition(" ")
    if "%" not in target and "+" not in target:
        return first_line
    path, question, query = target.partition("?")
    return f"{method} {_settled(path)}{question}{_settled(unquote_plus(query))} {version}"


def is_json(content_type: str | None) -> bool:
    """Whether a body of this content type is JSON: one document (``application/json``, ``...+json``,
    ``x-json``, ``text/json``) or JSON lines (``x-ndjson``, ``jsonl``, ``json-seq``)."""
    return bool(content_type) and _JSON_TYPE.match(content_type) is not None  # type: ignore[arg-type]


def is_binary(content_types: Iterable[str]) -> bool:
    """Whether a response body with these ``Content-Type`` values is binary, which output rules and masks do
    not read: only known binary types (images but SVG, audio, video, fonts, archives, ``octet-stream``, PDF...).
    No type, any other type, or several of which one is not binary: read as text (fail closed)."""
    seen = False
    for content_type in content_types:
        if _BINARY_TYPE.match(content_type) is None:
            return False
        seen = True
    return seen


def content_codings(headers: Iterable[tuple[str, str]]) -> list[str]:
    """Every coding applied to a response body, in the order applied: each ``Content-Encoding`` header's
    list, then the ``Transfer-Encoding`` ones but ``chunked`` (lowered; ``identity`` left out)."""
    content: list[str] = []
    transfer: list[str] = []
    for name, value in headers:
        lower = name.lower()
        if lower == "content-encoding" or lower == "transfer-encoding":
            for coding in value.split(","):
                coding = coding.strip().lower()
                if coding and coding != "identity" and coding != "chunked":
                    (content if lower == "content-encoding" else transfer).append(coding)
    return content + transfer


def decoded_body(body: bytes, codings: list[str], limit: int) -> tuple[bytes, bool] | None:
    """A body with its ``codings`` (``content_codings``) undone, last applied first: at most ``limit`` bytes of
    it, and whether that is all of it (each coding's stream ended within ``limit``; a prefix of a body decodes
    to a prefix). None: a coding the gateway cannot decode (``br``, ``zstd``...) or a corrupt stream. A
    compression bomb is never inflated past ``limit``."""
    whole = True
    for coding in reversed(codings):
        undone = _undo(body, coding, limit)
        if undone is None:
            return None
        body, ended = undone
        whole = whole and ended
    return body, whole


def _undo(body: bytes, coding: str, limit: int) -> tuple[bytes, bool] | None:
    """One ``gzip`` (every member) or ``deflate`` (zlib-wrapped as the RFC says, or raw as some servers send
    it) coding undone, at most ``limit`` bytes, and whether its stream ended there; None: not decodable."""
    if coding in ("gzip", "x-gzip"):
        tries = [16 + zlib.MAX_WBITS]
    elif coding == "deflate":
        tries = [zlib.MAX_WBITS, -zlib.MAX_WBITS]
    else:
        return None
    for wbits in tries:
        out = bytearray()
        rest = body
        try:
            while True:
                decoder = zlib.decompressobj(wbits)
                out += decoder.decompress(rest, limit + 1 - len(out))
                if len(out) > limit or decoder.unconsumed_tail:
                    return bytes(out[:limit]), False
                if not decoder.eof:
                    return bytes(out), False  # a prefix of the stream
                rest = decoder.unused_data
                if not rest:
                    return bytes(out), True
                if coding == "deflate":  # bytes after its end: not a deflate stream (only gzip has members)
                    break
        except zlib.error:
            continue
    return None


def body_codec(content_type: str | None, body: bytes) -> str | None:
    """The Python codec a text body is read in: its byte order mark's (as browsers do), else its declared
    ``charset``, else UTF-8; None: a charset Python cannot decode."""
    if body[:3] == b"\xef\xbb\xbf":
        return "utf-8"
    if body[:2] in (b"\xff\xfe", b"\xfe\xff"):
        return "utf-16"
    charset = _CHARSET.search(content_type) if content_type else None
    if charset is None:
        return "utf-8"
    try:
        info = codecs.lookup(charset[1])
    except LookupError:
        return None
    return info.name if getattr(info, "_is_text_encoding", True) else None


@functools.lru_cache(maxsize=64)
def ascii_compatible(codec: str) -> bool:
    """Whether text in ``codec`` writes ASCII as ASCII, one byte each, with no shift state: its bytes can be
    masked as they are (a value the patterns find is the same bytes). Else the body is decoded first."""
    if codec.startswith(("iso2022", "utf_7", "utf-7", "hz")):
        return False
    ascii_text = "".join(map(chr, range(128)))
    try:
        return bytes(range(128)).decode(codec) == ascii_text and ascii_text.encode(codec) == bytes(range(128))
    except (UnicodeError, LookupError):
        return False


def is_event_stream(content_type: str | None) -> bool:
    return content_type is not None and content_type.split(";", 1)[0].strip().lower() == "text/event-stream"


def is_websocket_upgrade(headers: Iterable[tuple[str, str]]) -> bool:
    connection = upgrade = False
    for name, value in headers:
        lower = name.lower()
        if lower == "connection" and "upgrade" in value.lower():
            connection = True
        elif lower == "upgrade" and value.strip().lower() == "websocket":
            upgrade = True
    return connection and upgrade


def redact_header(name: str, value: str) -> str:
    """A header value safe to record: credentials and cookie values replaced, cookie names kept."""
    lower = name.lower()
    if lower not in _SECRET_HEADERS:
        return scrub(value)
    if lower == "cookie":
        return "; ".join(f"{p.strip().partition('=')[0]}={REDACTED}" for p in value.split(";") if p.strip())
    if lower == "set-cookie":
        cookie_name, _, rest = value.partition("=")
        attributes = rest.partition(";")[2]
        return f"{cookie_name}={REDACTED}" + (f";{attributes}" if attributes else "")
    if lower in ("authorization", "proxy-authorization"):
        scheme, sep, _ = value.strip().partition(" ")
        return f"{scheme} {REDACTED}" if sep and not _is_proxy_secret(scheme) else REDACTED
    return REDACTED


def scrub(text: str) -> str:
    """Any gateway HTTP credential in ``text`` replaced (query strings, Referer...)."""
    return _SECRET_TEXT.sub(REDACTED, text) if "httpproxy-" in text else text


def scrub_bytes(data: bytes) -> bytes:
    """``scrub`` for a body to record."""
    return _SECRET_BYTES.sub(REDACTED.encode(), data) if b"httpproxy-" in data else data


def head_text(first_line: str, headers: Iterable[tuple[str, str]]) -> str:
    """The start line and the redacted headers, as they would look on the wire.

    Credential headers are redacted one by one; a gateway secret anywhere
    else is scrubbed from the whole text at once (it cannot span a line).
    """
    lines = [first_line]
    for name, value in headers:
        if name.lower() in _SECRET_HEADERS:
            value = redact_header(name, value)
        lines.append(f"{name}: {value}")
    lines.append("\r\n")
    return scrub("\r\n".join(lines))


def head_bytes(first_line: str, headers: Iterable[tuple[str, str]]) -> bytes:
    """``head_text`` as the bytes to record: header bytes that are not UTF-8 come back as they were sent."""
    return head_text(first_line, headers).encode("utf-8", "surrogateescape")


def body_note(recorded: int, total: int | None, complete: bool) -> str:
    """What follows a recorded body that is not whole: how much was kept of how much."""
    if complete and (total is None or recorded >= total):
        return ""
    size = f"{total} bytes" if total is not None else "a size not known yet (streamed)"
    return f"\r\n[body: {recorded} of {size} recorded]"


def recorded_body(kept: bytes, total: int | None, complete: bool) -> bytes:
    """What is recorded of a body, either way: the part kept, any gateway credential in it scrubbed (a target
    may echo what the client sent), then the note of what was not kept (``body_note``)."""
    return scrub_bytes(kept) + body_note(len(kept), total, complete).encode()


def recorded_message(data: bytes | str, cap: int) -> bytes | str:
    """What is recorded of a websocket message: as a body is (``recorded_body``), its first ``cap`` bytes kept
    and the note of the rest; a text message that fits stays text."""
    if isinstance(data, str):
        if len(data) * 4 <= cap or len(raw := data.encode("utf-8", "surrogateescape")) <= cap:
            return scrub(data)
        data = raw
    return recorded_body(data[:cap], len(data), True)


def guard_text(first_line: str, headers: Iterable[tuple[str, str]], body: bytes | str = b"") -> str:
    """What input rules read: request line, headers and the text body, any gateway credential removed."""
    lines = [first_line]
    for name, value in headers:
        lines.append(f"{name}: {value}")
    text = "\r\n".join(lines)
    if body:
        text += "\r\n\r\n" + (body if isinstance(body, str) else body.decode("utf-8", "replace"))
    return scrub(text)  # never a credential: not in the rules' reading, nor in a block's audit entry


def guard_readings(first_line: str, headers: list[tuple[str, str]], body: str = "",
                   decoded: str = "") -> tuple[str, tuple[str, ...] | None]:
    """What input rules read of a request: ``guard_text`` as sent, and the readings to check (all of them) when
    the target decodes something that text spells otherwise -- the request line by ``decoded_line``, the body
    as ``body_readings`` gives it (``decoded``) -- else None (the text alone says it all)."""
    text = guard_text(first_line, headers, body)
    line = decoded_line(first_line)
    if line == first_line and decoded == body:
        return text, None
    return text, (text, guard_text(line, headers, decoded))

