"""Authentication: OIDC login and callback, local login, user info and multi-tenant signup."""

from __future__ import annotations

import math
import time
from datetime import datetime, timezone
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import jwt
from aiohttp import web

from control.http import (
    AUDIT_ACTION,
    AUDIT_ACTOR_HINT,
    AUDIT_ORG,
    AUTH_FAILURE,
    BEARER,
    USER,
    ApiError,
    Field,
    Param,
    RouteSet,
    Schema,
    json_body,
    ok,
    services_of,
    user_of,
)
from gatewayd.apikeys import looks_like_key
from gatewayd.identity import AuthError, Throttled
from gatewayd.models import User, rfc3339

routes = RouteSet("Authentication", audit="auth")

LOCAL_LOGIN = Schema("LocalLogin", {
    "email": Field("string", True), "password": Field("string", True),
    "org_id": Field("string", description="the organization of the account (e-mails are unique per organization); "
                                          "default: the default organization (every account in single-tenant "
                                          "mode)")})
SIGNUP = Schema("Signup", {"org_name": Field("string", True), "profile_name": Field("string"),
                           "profile_picture": Field("string")})

_TEXT = Field("string", True)
USER_FIELDS_OUT = {
    "id": _TEXT, "email": _TEXT, "name": _TEXT, "subject": _TEXT, "status": _TEXT,
    "groups": Field("array", True, items="string"), "is_admin": Field("boolean", True),
    "is_auditor": Field("boolean", True), "is_operator": Field("boolean", True), "org_id": Field("string", True, nullable=True), "org_name": _TEXT,
    "picture": _TEXT, "slack_id": _TEXT, "created_at": _TEXT, "updated_at": _TEXT,
}
USER_OUT = Schema("User", USER_FIELDS_OUT)
USERINFO_OUT = Schema("UserInfo", {**USER_FIELDS_OUT, "tenancy_type": Field("string", True,
                                                                            enum=("multitenant", "selfhosted"))})


def user_json(user: User, org_name: str = "") -> dict:
    return {
        "id": user.id, "email": user.email, "name": user.name, "subject": user.subject, "status": user.status,
        "groups": user.groups, "is_admin": user.is_admin, "is_auditor": user.is_auditor,
        "is_operator": user.operator, "org_id": user.org_id,
        "org_name": org_name, "picture": user.picture, "slack_id": user.slack_id,
        "created_at": user.created_at, "updated_at": user.updated_at,
    }


def _with_token(url: str, token: str) -> str:
    parts = urlsplit(url)
    query = parse_qsl(parts.query) + [("token", token)]
    return urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(query), parts.fragment))


@routes.get("/login", "Authorization URL of the identity provider (state and PKCE)", public=True,
            query=[Param("redirect", description="where to send the browser with ?token= after login")],
            response=Schema("LoginUrl", {"login_url": _TEXT}))
async def login(request: web.Request) -> web.Response:
    services = services_of(request)
    redirect = request.query.get("redirect") or f"{services.config.public_url}/"
    try:
        url = await services.identity.login_url(redirect)
    except AuthError as exc:
        raise ApiError(400, str(exc)) from None
    return ok({"login_url": url})


@routes.get("/callback", "Receives the authorization code and redirects with a token", public=True,
            query=[Param("code"), Param("state"), Param("error")], status=302)
async def callback(request: web.Request) -> web.StreamResponse:
    services = services_of(request)
    if request.query.get("error"):
        request[AUDIT_ACTION] = "auth.login"
        raise ApiError(401, f"login refused by the identity provider: {request.query['error']}")
    try:
        token, redirect, user = await services.identity.callback(request.query.get("code", ""),
                                                                request.query.get("state", ""))
    except AuthError as exc:
        request[AUDIT_ACTION] = "auth.login"  # the audit middleware writes the refusal
        request[AUTH_FAILURE] = str(exc)
        raise ApiError(401, "access denied") from None
    await services.audit.record(org_id=user.org_id or (await services.store.default_org()).id, actor=user,
                               action="auth.login", resource_type="auth", outcome="success", http_method="GET",
                               http_path=request.path, http_status=302, client_ip=request.remote or "")
    raise web.HTTPFound(_with_token(redirect, token))


@routes.post("/localauth/login", "Local login with email and password", body=LOCAL_LOGIN, public=True,
             response=Schema("Token", {"token": _TEXT}))
async def local_login(request: web.Request) -> web.Response:
    body = await json_body(request, LOCAL_LOGIN)
    request[AUDIT_ACTOR_HINT] = body["email"]
    request[AUDIT_ACTION] = "auth.local_login"
    services = services_of(request)
    org_id = await services.identity.login_org(body.get("org_id"))
    if await services.store.get_org(org_id) is not None:
        request[AUDIT_ORG] = org_id  # a refusal goes to the log of the organization the login was for
    try:
        token, user = await services.identity.local_login(body["email"], body["password"], request.remote or "",
                                                         org_id)
    except Throttled as exc:
        raise ApiError(429, str(exc), {"Retry-After": str(math.ceil(exc.retry_after))}) from None
    except AuthError as exc:
        if exc.blocked:  # throttling starts now: one entry per account or address and window, not one per try
            await services.audit.record(
                org_id=request.get(AUDIT_ORG) or (await services.store.default_org()).id, actor=None,
                action="auth.throttle",
                resource_type="auth", outcome="failure", actor_hint=body["email"], client_ip=request.remote or "",
                error_message=f"too many refused logins: refused for {int(services.config['throttle.login_window'])} s",
                payload={"throttled": exc.blocked})
        raise ApiError(401, "access denied") from None
    request[USER] = user  # the audit entry is the user's, in the user's organization's log
    return ok({"token": token})


def _signed_in_token(request: web.Request, what: str) -> str:
    """The token this call authenticated with; 400 for an API key, which is no sign-in's (revoked with its
    route, never turned into a token)."""
    token = request[BEARER]
    if looks_like_key(token):
        raise ApiError(400, f"API keys are not {what}: a key lasts until it is revoked (DELETE /api/orgs/keys, "
                            "or a new server key rolled out)")
    return token


@routes.post("/logout", "Sign out: the token of this call is refused from now on, on every node", status=204)
async def logout(request: web.Request) -> web.Response:
    await services_of(request).identity.revoke(_signed_in_token(request, "signed out"))
    return web.Response(status=204)


@routes.post("/token/refresh", "A fresh token for the caller that lasts console.idle_timeout (the web console "
             "renews its token while it is used: an idle one is signed out by the gateway); a longer-lived token "
             "sent here is signed out. No renewal goes past auth.token_ttl after the sign-in",
             response=Schema("RefreshedToken", {"token": _TEXT, "expires_at": _TEXT,
                                                "idle_timeout": Field("integer", True, minimum=1,
                                                                      description="seconds")}))
async def refresh_token(request: web.Request) -> web.Response:
    services = services_of(request)
    token = _signed_in_token(request, "refreshed")
    claims = jwt.decode(token, options={"verify_signature": False})
    now = time.time()
    signed_in = float(claims.get("auth_time") or claims.get("iat") or now)
    left = signed_in + services.config["auth.token_ttl"] - now
    if left < 1:
        raise ApiError(401, "access denied: the sign-in is over, sign in again")
    idle = services.config["console.idle_timeout"]
    ttl = min(idle, left)
    fresh = services.identity.issue_token(user_of(request), ttl, auth_time=signed_in)
    if float(claims.get("exp") or 0) - now > idle:  # a long-lived token (a sign-in's) does not stay behind
        await services.identity.revoke(token)
    expires = datetime.fromtimestamp(now + int(ttl), timezone.utc)
    return ok({"token": fresh, "expires_at": rfc3339(expires), "idle_timeout": int(idle)})


@routes.get("/userinfo", "The authenticated user", response=USERINFO_OUT)
async def userinfo(request: web.Request) -> web.Response:
    user = user_of(request)
    org = await services_of(request).store.get_org(user.org_id) if user.org_id else None
    data = user_json(user, org.name if org else "")
    data["tenancy_type"] = "multitenant" if services_of(request).config["auth.multi_tenant"] else "selfhosted"
    return ok(data)


@routes.post("/signup", "Create an organization for an authenticated user without one (multi-tenant only)",
             body=SIGNUP, status=201, response=Schema("SignupResult", {
                 "org_id": _TEXT, "org_name": _TEXT, "profile_name": _TEXT, "profile_picture": _TEXT}))
async def signup(request: web.Request) -> web.Response:
    services = services_of(request)
    if not services.config["auth.multi_tenant"]:
        raise ApiError(403, "signup is only available in multi-tenant mode")
    body = await json_body(request, SIGNUP)
    user = user_of(request)
    if user.org_id:
        raise ApiError(409, "the user already belongs to an organization")
    if not body["org_name"].strip():
        raise ApiError(400, "field 'org_name' is required")
    org = await services.store.create_org(body["org_name"].strip())
    user.org_id = org.id
    user.name = body.get("profile_name") or user.name
    user.picture = body.get("profile_picture") or user.picture
    # the founder administers the new organization: a grant of the gateway, kept when the provider syncs groups
    user.granted_groups = sorted(set(user.granted_groups) | {"admin"})
    user.groups = sorted(set(user.groups) | {"admin"})
    await services.store.save_user(user)
    return ok({"org_id": org.id, "org_name": org.name, "profile_name": user.name,
               "profile_picture": user.picture}, status=201)
