"""Identity: the local token issuer, the OIDC verifier, sign-up on first login and group sync."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import math
import logging
import re
import secrets
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlencode, urlsplit

import aiohttp
import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from gatewayd.apikeys import RESERVED_SUBJECT, ApiKeys, looks_like_key
from gatewayd.config import Config
from gatewayd.crypto import PasswordWork
from gatewayd.throttle import Throttle
from gatewayd.models import User, new_id, rfc3339, utcnow
from gatewayd.store import Store
from gatewayd.tasks import together

log = logging.getLogger("gatewayd.identity")

LOCAL_ISSUER = "gatewayd"
LOCAL_AUDIENCE = "gatewayd-api"
_ASYMMETRIC = {"RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"}
_KEY_TYPES = {"RS": "RSA", "PS": "RSA", "ES": "EC", "Ed": "OKP"}
_STATE_TTL = 600
VERIFIED_CAP = 4096  # local tokens a process remembers as verified (LocalIssuer.verify); past it, it starts over
AUTH_SETTINGS = "serverconfig.auth"  # the store's setting of the sign-in configuration an operator put
AUTH_CHANGED = "serverconfig.auth.changed"  # the bus topic: every node reloads its sign-in settings
AUTH_CLIENT_SECRET = "serverconfig.auth.client_secret"  # its OIDC client secret, sealed in the store's keys
AUTH_KEYS = frozenset({"auth.issuer", "auth.oidc.issuer_url", "auth.oidc.client_id", "auth.oidc.audience",
                       "auth.oidc.scopes", "auth.oidc.groups_claim"})
_JWKS_MAX_AGE = 600
LOOPBACK_STATE = re.compile(r"state=[A-Za-z0-9_-]{16,128}")  # the CLI's loopback redirect: its check on the answer


class AuthError(Exception):
    """Authentication failed; the API answers 401 ``access denied``. ``blocked``: throttle keys this
    refusal blocked (``account:...``, ``address:...``), for one audit entry when throttling starts."""

    def __init__(self, message: str, blocked: list[str] | None = None) -> None:
        super().__init__(message)
        self.blocked = blocked or []


class Throttled(AuthError):
    """Too many refused logins for this account or address: try again in ``retry_after`` seconds."""

    def __init__(self, retry_after: float) -> None:
        super().__init__(f"too many refused logins: try again in {math.ceil(retry_after)} s")
        self.retry_after = retry_after


@dataclass(slots=True)
class Claims:
    subject: str
    email: str
    name: str
    groups: list[str] | None
    picture: str = ""
    email_verified: bool | None = None


class LocalIssuer:
    """Signs and verifies the gateway's own short-lived Ed25519 JWTs."""

    def __init__(self, private_key: Ed25519PrivateKey, kid: str) -> None:
        self._private = private_key
        self._public = private_key.public_key()
        self.kid = kid
        # SHA-256 of a token -> (valid from, expiry, its claims), for the tokens verified here (not the tokens
        # themselves: a bearer secret is not kept longer than its request)
        self._verified: dict[bytes, tuple[int, int, dict[str, Any]]] = {}

    @classmethod
    async def load(cls, store: Store) -> "LocalIssuer":
        material = await store.get_key("local-issuer")
        if material is None:
            key = Ed25519PrivateKey.generate()
            material = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                         serialization.NoEncryption())
            await store.put_key("local-issuer", material)
            material = await store.get_key("local-issuer") or material  # a concurrent start may have won
        loaded = serialization.load_pem_private_key(material, None)
        assert isinstance(loaded, Ed25519PrivateKey)
        key = loaded
        public = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return cls(key, hashlib.sha256(public).hexdigest()[:16])

    def issue(self, user: User, ttl: float, auth_time: float | None = None) -> str:
        """A token naming the user by its id, which is never reused: deleting the user ends its tokens for good,
        even when the e-mail comes back as a new user. ``auth_time``: when the user signed in (a refreshed
        token keeps the sign-in's)."""
        now = time.time()  # iat to the microsecond: a password change at second S ends the tokens issued before it
        claims = {"iss": LOCAL_ISSUER, "aud": LOCAL_AUDIENCE, "sub": user.id, "email": user.email,
                  "name": user.name, "iat": now, "nbf": int(now), "exp": now + int(ttl), "jti": new_id(),
                  "auth_time": now if auth_time is None else auth_time}
        return jwt.encode(claims, self._private, algorithm="EdDSA", headers={"kid": self.kid})

    def verify(self, token: str) -> dict[str, Any]:
        """The claims of a token this issuer signed, within its time; else AuthError.

        Every API request carries its token, and checking its signature is most of the cost of reading it (200 us
        of Ed25519 on the development machine). A token verified once is remembered with its claims (up to
        ``VERIFIED_CAP``): the same string is taken again without the signature check while its time holds by the
        rules jwt.decode applies (``iat`` and ``nbf`` not after now, ``exp`` after it, each as an integer), and
        decoded whole again otherwise, which refuses it. Only the claims are remembered, under the token's SHA-256
        (the bearer secret itself is not kept past its request); whether the token was signed out, its user and
        the user's password change are read from the store at every request, as before
        (``Identity.authenticate``)."""
        key = hashlib.sha256(token.encode()).digest()
        known = self._verified.get(key)
        if known is not None and known[0] <= time.time() < known[1]:
            return dict(known[2])
        try:
            claims: dict[str, Any] = jwt.decode(token, self._public, algorithms=["EdDSA"], audience=LOCAL_AUDIENCE,
                                                issuer=LOCAL_ISSUER, options={"require": ["exp", "iat", "sub"]})
        except jwt.PyJWTError as exc:
            self._verified.pop(key, None)
            raise AuthError(f"local token refused: {exc}") from None
        if len(self._verified) >= VERIFIED_CAP:
            self._verified.clear()
        valid_from = max(int(claims["iat"]), int(claims.get("nbf", claims["iat"])))  # jwt.decode read them so
        self._verified[key] = (valid_from, int(claims["exp"]), claims)
        return dict(claims)

    def remembers(self, token: str) -> bool:
        """Whether ``token`` is one this issuer verified (its issuer, then, without decoding it again)."""
        return hashlib.sha256(token.encode()).digest() in self._verified


class OIDCProvider:
    """Verifies tokens of an external identity provider and runs the authorization-code flow."""

    def __init__(self, config: Config, http: aiohttp.ClientSession) -> None:
        self.issuer = config["auth.oidc.issuer_url"].rstrip("/")
        self.client_id = config["auth.oidc.client_id"]
        self.client_secret = config["auth.oidc.client_secret"]
        self.audience = config["auth.oidc.audience"] or self.client_id
        self.scopes = config["auth.oidc.scopes"]
        self.groups_claim = config["auth.oidc.groups_claim"]
        self.algorithms = [a for a in config["auth.oidc.algorithms"] if a in _ASYMMETRIC]
        self.http = http
        self._discovery: dict[str, Any] | None = None
        self._keys: dict[str, jwt.PyJWK] = {}
        self._keys_fetched = 0.0
        self._lock = asyncio.Lock()

    async def discovery(self) -> dict[str, Any]:
        if self._discovery is None:
            url = f"{self.issuer}/.well-known/openid-configuration"
            try:
                async with self.http.get(url) as response:
                    if response.status != 200:
                        raise AuthError(f"identity provider discovery failed with HTTP {response.status}")
                    document = await response.json(content_type=None)
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:  # down, or not a provider at all
                raise AuthError(f"identity provider discovery failed: {type(exc).__name__}") from None
            if not isinstance(document, dict) or not isinstance(document.get("jwks_uri"), str):
                raise AuthError("identity provider discovery failed: not a discovery document")
            self._discovery = document
        return self._discovery

    async def _refresh_keys(self) -> None:
        async with self._lock:
            if time.monotonic() - self._keys_fetched < 1.0:
                return  # another task just refreshed
            doc = await self.discovery()
            try:
                async with self.http.get(doc["jwks_uri"]) as response:
                    if response.status != 200:
                        raise AuthError(f"identity provider JWKS fetch failed with HTTP {response.status}")
                    jwks = await response.json(content_type=None)
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                raise AuthError(f"identity provider JWKS fetch failed: {type(exc).__name__}") from None
            if not isinstance(jwks, dict):
                raise AuthError("identity provider JWKS fetch failed: not a key set")
            keys = {}
            for item in jwks.get("keys", []):
                try:
                    key = jwt.PyJWK(item)
                except jwt.PyJWTError:
                    continue
                keys[item.get("kid", "")] = key
            self._keys = keys
            self._keys_fetched = time.monotonic()

    async def _key_for(self, kid: str) -> jwt.PyJWK:
        stale = time.monotonic() - self._keys_fetched > _JWKS_MAX_AGE
        if kid not in self._keys or stale:
            await self._refresh_keys()  # unknown kid: the provider may have rotated; stale: it may have withdrawn one
        key = self._keys.get(kid)
        if key is None:
            raise AuthError("token signed with an unknown key")
        return key

    async def verify(self, token: str) -> dict[str, Any]:
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise AuthError("malformed token") from None
        alg = header.get("alg")
        if not isinstance(alg, str) or alg not in self.algorithms:
            raise AuthError(f"token algorithm {alg!r} is not allowed")
        key = await self._key_for(header.get("kid", ""))
        if _KEY_TYPES[alg[:2]] != key.key_type:
            raise AuthError("token algorithm does not match its key")
        try:
            return jwt.decode(token, key.key, algorithms=[alg], audience=self.audience, issuer=self.issuer,
                              options={"require": ["exp", "iat", "sub"]}, leeway=30)
        except jwt.PyJWTError as exc:
            raise AuthError(f"token refused: {exc}") from None

    def claims(self, payload: dict[str, Any]) -> Claims:
        groups = payload.get(self.groups_claim)
        if isinstance(groups, str):
            groups = [groups]
        if groups is not None and not isinstance(groups, list):
            groups = None
        verified = payload.get("email_verified")
        return Claims(subject=str(payload["sub"]), email=str(payload.get("email") or payload["sub"]),
                      name=str(payload.get("name") or ""), picture=str(payload.get("picture") or ""),
                      groups=[str(g) for g in groups] if groups is not None else None,
                      email_verified=verified if isinstance(verified, bool) else None)

    async def authorization_url(self, state: str, challenge: str, redirect_uri: str) -> str:
        doc = await self.discovery()
        query = {"response_type": "code", "client_id": self.client_id, "redirect_uri": redirect_uri,
                 "scope": " ".join(self.scopes), "state": state, "code_challenge": challenge,
                 "code_challenge_method": "S256"}
        if self.audience != self.client_id:
            query["audience"] = self.audience
        endpoint = doc.get("authorization_endpoint")
        if not isinstance(endpoint, str):
            raise AuthError("the identity provider names no authorization endpoint")
        return f"{endpoint}?{urlencode(query)}"

    async def exchange(self, code: str, verifier: str, redirect_uri: str) -> dict[str, Any]:
        doc = await self.discovery()
        form = {"grant_type": "authorization_code", "code": code, "redirect_uri": redirect_uri,
                "client_id": self.client_id, "code_verifier": verifier}
        if self.client_secret:
            form["client_secret"] = self.client_secret
        endpoint = doc.get("token_endpoint")
        if not isinstance(endpoint, str):
            raise AuthError("the identity provider names no token endpoint")
        try:
            async with self.http.post(endpoint, data=form) as response:
                body = await response.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise AuthError(f"the identity provider could not be asked for the token: {type(exc).__name__}") from None
        if response.status != 200 or not isinstance(body, dict) or "id_token" not in body:
            raise AuthError(f"the identity provider refused the code (HTTP {response.status})")
        return body


_LOGIN_KEY_PREFIX = "oidc-login:"
_REVOKED_PREFIX = "revoked-token:"  # + _signed_part's SHA-256: a token signed out (POST /logout), until it expires
_REVOKED_LONG_PREFIX = "revoked-long-token:"  # the same, for a token meant to live longer than SHORT_LIVED_TOKEN
_TOKENS_AFTER_PREFIX = "tokens-after:"  # + a user id: tokens issued before this moment (a password change) are dead
SHORT_LIVED_TOKEN = 48 * 3600.0  # a revoked token of at most this lifetime is forgotten that long after it was revoked
_B64URL_PART = re.compile(r"[A-Za-z0-9_-]+")


def is_compact(token: str) -> bool:
    """Whether ``token`` is a JWT in its one canonical spelling: three base64url parts without padding whose
    last characters carry no stray bits, nothing else. PyJWT also takes padded parts, and base64 ignores a last
    character's unused bits: other spellings of the same signature, which the gateway refuses."""
    parts = token.split(".")
    if len(parts) != 3:
        return False
    for part in parts:
        if not _B64URL_PART.fullmatch(part) or len(part) % 4 == 1:
            return False
        decoded = base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))
        if base64.urlsafe_b64encode(decoded).rstrip(b"=").decode() != part:
            return False
    return True


def _signed_part(token: str) -> str:
    """What a token's signature covers (header and claims, as sent): the same for every spelling of its signature
    (padding, stray bits, an ECDSA signature's other half), none of which changes what was signed."""
    return token.rpartition(".")[0]


def _revoked_key(token: str, payload: dict[str, Any], legacy: bool = False) -> str:
    """The store's name of a signed-out token: the hash of what its signature covers, under a prefix that says
    whether it may be forgotten ``SHORT_LIVED_TOKEN`` after (it expired by then) or is kept (a token minted to
    live longer). ``legacy``: the name sign-outs had before, the hash of the token's text."""
    try:
        lifetime = float(payload["exp"]) - float(payload["iat"])
    except (KeyError, TypeError, ValueError):
        lifetime = float("inf")
    prefix = _REVOKED_PREFIX if lifetime <= SHORT_LIVED_TOKEN else _REVOKED_LONG_PREFIX
    return prefix + hashlib.sha256((token if legacy else _signed_part(token)).encode()).hexdigest()


def org_subject(multi_tenant: bool, org_id: str | None, name: str) -> str:
    """The subject of an account an organization's admin names (a user by e-mail, a service account by its
    provider subject). In multi-tenant mode it lives in the organization's namespace, ``<org id>/<name>``: no
    organization holds, blocks or learns of another's subject, nor of a person who has not signed in yet (a
    person's own subject is the provider's, in no namespace). Single-tenant mode keeps the name."""
    if not multi_tenant or name.startswith(f"{org_id}/"):
        return name
    return f"{org_id}/{name}"


def _login_key(state: str) -> str:
    """The store's name of a pending login: a hash of its state (the state itself is not kept)."""
    return _LOGIN_KEY_PREFIX + hashlib.sha256(state.encode()).hexdigest()


@dataclass(slots=True)
class _PendingLogin:
    verifier: str
    redirect: str
    expires: float


def _under(prefix: str, redirect: str) -> bool:
    """Whether ``redirect`` is under the allowed ``prefix`` as an address: the same scheme, host and port (the
    prefix's text alone let ``http://h:1`` pass ``http://h:1@evil.example/`` and ``http://h:19/``), and the prefix's
    text after that."""
    allowed, target = urlsplit(prefix), urlsplit(redirect)
    return (target.scheme, target.netloc) == (allowed.scheme, allowed.netloc) and redirect.startswith(prefix)


class Identity:
    """Turns bearer tokens into active users; signs users up on first authentication."""

    def __init__(self, config: Config, store: Store) -> None:
        self.base_config = config  # the file's; ``config`` adds what an operator stored (``reload_auth``)
        self.config = config
        self.store = store
        self.local: LocalIssuer | None = None
        self.oidc: OIDCProvider | None = None
        self._http: aiohttp.ClientSession | None = None
        self.passwords = PasswordWork()
        self.login_throttle = Throttle(config["throttle.login_failures"], config["throttle.login_window"])
        self.keys = ApiKeys(store)

    async def start(self) -> None:
        self.local = await LocalIssuer.load(self.store)
        await self.reload_auth()

    async def reload_auth(self) -> None:
        """Take the sign-in settings an operator stored (``PUT /serverconfig/auth``) over the file's, and
        (re)make the OIDC provider they name: at start, and when any node changed them."""
        stored = await self.store.get_setting(AUTH_SETTINGS) or {}
        overrides = {key: value for key, value in stored.items() if key in AUTH_KEYS}
        if stored.get("auth.issuer") == "oidc":
            secret = await self.store.get_key(AUTH_CLIENT_SECRET)
            overrides["auth.oidc.client_secret"] = secret.decode() if secret else ""
        self.config = Config({**self.base_config.as_dict(), **overrides}, self.base_config.source)
        if self.config["auth.issuer"] == "oidc":
            if self._http is None:
                self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15))
            self.oidc = OIDCProvider(self.config, self._http)
        else:
            self.oidc = None

    async def stop(self) -> None:
        if self._http is not None:
            await self._http.close()

    @property
    def callback_url(self) -> str:
        return self.config["auth.oidc.redirect_url"] or f"{self.config.public_url}/api/callback"

    def issue_token(self, user: User, ttl: float | None = None, auth_time: float | None = None) -> str:
        assert self.local is not None
        return self.local.issue(user, ttl if ttl is not None else self.config["auth.token_ttl"], auth_time)

    async def authenticate(self, token: str) -> User:
        """The active user behind a bearer token, or AuthError (a token signed out or issued before the user's
        last password change included)."""
        assert self.local is not None
        if looks_like_key(token):
            found = await self.keys.authenticate(token)
            if found is None:
                raise AuthError("unknown or revoked API key")
            return found
        if not is_compact(token):  # the one spelling a sign-out is checked under (another one is refused)
            raise AuthError("malformed token")
        issuer: Any = LOCAL_ISSUER
        if not self.local.remembers(token):
            try:
                issuer = jwt.decode(token, options={"verify_signature": False}).get("iss")
            except jwt.PyJWTError:
                raise AuthError("malformed token") from None
        if issuer == LOCAL_ISSUER:
            payload = self.local.verify(token)
            # the user, whether the token was signed out, and the user's password change: read at once (each
            # request pays for these before its own work)
            user, revoked, revoked_before, cutoff = await together(
                self.store.get_user(id=str(payload["sub"])), self.store.get_key(_revoked_key(token, payload)),
                self.store.get_key(_revoked_key(token, payload, legacy=True)),
                self.store.get_key(_TOKENS_AFTER_PREFIX + str(payload["sub"])))
        elif self.oidc is not None:
            payload = await self.oidc.verify(token)
            user = await self.sign_in(self.oidc.claims(payload))
            if user is None:
                raise AuthError("unknown user")
            revoked, revoked_before, cutoff = await together(
                self.store.get_key(_revoked_key(token, payload)),
                self.store.get_key(_revoked_key(token, payload, legacy=True)),
                self.store.get_key(_TOKENS_AFTER_PREFIX + user.id))
        else:
            raise AuthError("token from an unknown issuer")
        if user is None:
            raise AuthError("unknown user")
        if user.status != "active":
            raise AuthError("inactive user")
        if revoked is not None or revoked_before is not None:
            raise AuthError("token signed out")
        if cutoff is not None and float(payload["iat"]) < float(cutoff):
            raise AuthError("token issued before the user's password last changed")
        return user

    async def revoke(self, token: str) -> None:
        """Sign ``token`` out (a token ``authenticate`` took): refused from now on, on every node, until it would
        have expired anyway."""
        payload = jwt.decode(token, options={"verify_signature": False})
        await self.store.put_key(_revoked_key(token, payload), str(payload.get("exp", "")).encode())
        await self.store.prune_keys(_REVOKED_PREFIX, rfc3339(utcnow() - timedelta(seconds=SHORT_LIVED_TOKEN)))

    async def revoke_tokens_of(self, user: User) -> None:
        """End every token ``user`` holds now (a password changed): those issued from now on are good."""
        await self.store.put_key(_TOKENS_AFTER_PREFIX + user.id, repr(time.time()).encode())

    def _check_link(self, user: User, claims: Claims) -> None:
        """May the provider identity of ``claims`` take over ``user``, a user created by e-mail (CLI,
        POST /users) that no identity claimed yet? AuthError when not."""
        if self.config["auth.multi_tenant"]:
            # the user was made by some organization's admin: linking would put the person in that organization
            raise AuthError("multi-tenant mode never links a sign-in to a user by e-mail")
        if user.federated or user.subject != user.email.lower() or claims.email.lower() != user.email.lower():
            raise AuthError("this email belongs to another identity")
        if claims.email_verified is not True and not self.config["auth.oidc.link_unverified_email"]:
            raise AuthError("the identity provider does not say this email is verified (email_verified)")

    async def sign_in(self, claims: Claims) -> User:
        """Find or create the user of ``claims``; merge the token's groups over the gateway's grants."""
        if claims.subject.startswith(RESERVED_SUBJECT):
            raise AuthError("this subject is reserved for the gateway's API keys")
        user = await self.store.get_user(subject=claims.subject)
        if (user is not None and user.service_account and self.config["auth.multi_tenant"]
                and user.subject != org_subject(True, user.org_id, user.subject)):
            # made before service accounts lived in their organization's namespace: it may be a person's subject,
            # claimed before the person's first sign-in
            raise AuthError("a service account outside its organization's namespace: make it again")
        if user is not None and not user.federated and user.subject == user.email.lower():
            self._check_link(user, claims)  # a provider subject equal to a local user's e-mail is a link too
            user.federated = True
            await self.store.save_user(user)
        if user is None and not self.config["auth.multi_tenant"]:
            user = await self.store.get_user(email=claims.email, org_id=(await self.store.default_org()).id)
            if user is not None:
                self._check_link(user, claims)
                user.subject, user.federated = claims.subject, True
                await self.store.save_user(user)
        if user is None:
            org_id = None if self.config["auth.multi_tenant"] else (await self.store.default_org()).id
            user = User(id=new_id(), org_id=org_id, subject=claims.subject, email=claims.email, name=claims.name,
                        picture=claims.picture, groups=sorted(set(claims.groups or [])), federated=True)
            return await self.store.save_user(user)
        changed = claims.groups is not None and user.sync_provider_groups(claims.groups)
        if claims.name and claims.name != user.name:
            user.name, changed = claims.name, True
        if changed:
            await self.store.save_user(user)
        return user

    async def ensure_local_user(self, email: str, name: str = "", groups: list[str] | None = None,
                                operator: bool = False) -> User:
        """The local user with ``email``, created if needed (on the host, by the CLI); ``groups`` replace its
        granted groups when given; ``operator`` makes it an operator of the whole gateway."""
        org = await self.store.default_org()  # the host's users: never one an organization made with that e-mail
        user = await self.store.get_user(email=email, org_id=org.id)
        if user is None:
            user = User(id=new_id(), org_id=org.id, subject=email.lower(), email=email, name=name,
                        operator=operator)
            user.grant_groups(groups or [])
            return await self.store.save_user(user)
        if groups is not None or (name and name != user.name) or (operator and not user.operator):
            if groups is not None:
                user.grant_groups(groups)
            user.name = name or user.name
            user.operator = user.operator or operator
            await self.store.save_user(user)
        return user

    def is_operator(self, user: User) -> bool:
        """May ``user`` change gateway-wide settings? Operators are made on the host; in single-tenant mode the
        admins of the one organization are operators too."""
        return user.operator or (not self.config["auth.multi_tenant"] and user.is_admin)

    async def login_org(self, org_id: str | None) -> str:
        """The organization a local login is for: the one named, else the default one (the host's users, and
        everyone's in single-tenant mode). E-mails are unique per organization, so a login names one."""
        return org_id or (await self.store.default_org()).id

    async def local_login(self, email: str, password: str, client_ip: str = "",
                          org_id: str | None = None) -> tuple[str, User]:
        """A token (and its user) for a right password of ``email`` in ``org_id`` (default: the default
        organization). Refusals are counted per account and per client address: past the limit both are
        refused (``Throttled``) without a password check until their window ends."""
        org = await self.login_org(org_id)
        keys = [f"account:{org}:{email.strip().lower()}"] + ([f"address:{client_ip}"] if client_ip else [])
        wait = self.login_throttle.retry_after(*keys)
        if wait:
            raise Throttled(wait)
        user = await self.store.get_user(email=email, org_id=org)
        if not await self.passwords.verify(password, user.password_hash if user is not None else None):
            raise AuthError("wrong email or password", blocked=self.login_throttle.failed(*keys))
        self.login_throttle.succeeded(keys[0])
        if user is None or user.status != "active":
            raise AuthError("inactive user")
        return self.issue_token(user), user

    def allowed_redirect(self, redirect: str) -> bool:
        """Tokens are only handed to the gateway's own origin, to configured prefixes, or to a loopback
        ``http://127.0.0.1:PORT/callback`` of the command line (a native app's redirect, RFC 8252 7.3:
        only a program on the user's own machine can listen there), with no query but the command line's
        ``state`` (handed back beside the token: its listener takes no token without it)."""
        if redirect.startswith("/") and not redirect.startswith("//"):
            return True
        own = urlsplit(self.config.public_url)
        target = urlsplit(redirect)
        if (target.scheme, target.netloc) == (own.scheme, own.netloc):
            return True
        if (target.scheme == "http" and target.hostname in ("127.0.0.1", "::1") and target.port
                and target.path == "/callback" and not target.username
                and (not target.query or LOOPBACK_STATE.fullmatch(target.query))):
            return True
        return any(_under(prefix, redirect) for prefix in self.config["auth.oidc.allowed_redirects"] if prefix)

    async def login_url(self, redirect: str) -> str:
        if self.oidc is None:
            raise AuthError("OIDC login is not configured; use POST /api/localauth/login")
        if not self.allowed_redirect(redirect):
            raise AuthError("redirect: not an allowed address (api.public_url's origin or auth.oidc.allowed_redirects)")
        if redirect.startswith("/"):
            redirect = self.config.public_url + redirect
        state = secrets.token_urlsafe(24)
        verifier = secrets.token_urlsafe(48)
        challenge = base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest()).rstrip(b"=").decode()
        # in the store, sealed: the callback may reach another worker or node than the login did
        await self.store.put_key(_login_key(state), json.dumps(
            {"verifier": verifier, "redirect": redirect, "expires": time.time() + _STATE_TTL}).encode())
        await self.store.prune_keys(_LOGIN_KEY_PREFIX, rfc3339(utcnow() - timedelta(seconds=_STATE_TTL)))
        return await self.oidc.authorization_url(state, challenge, self.callback_url)

    async def _take_pending(self, state: str) -> _PendingLogin | None:
        """The login ``state`` was issued for, once: of two callbacks with it, on any node, one gets it."""
        name = _login_key(state)
        material = await self.store.get_key(name)
        if material is None or not await self.store.delete_key(name):
            return None
        stored = json.loads(material)
        return _PendingLogin(stored["verifier"], stored["redirect"], float(stored["expires"]))

    async def callback(self, code: str, state: str) -> tuple[str, str, User]:
        """Exchange the code; returns (id token, where to redirect, user)."""
        if self.oidc is None:
            raise AuthError("OIDC login is not configured")
        pending = await self._take_pending(state)
        if pending is None or pending.expires < time.time():
            raise AuthError("unknown or expired login state")
        tokens = await self.oidc.exchange(code, pending.verifier, self.callback_url)
        id_token = tokens["id_token"]
        user = await self.sign_in(self.oidc.claims(await self.oidc.verify(id_token)))
        if user.status != "active":
            raise AuthError("inactive user")
        return id_token, pending.redirect, user
