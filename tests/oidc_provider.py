"""A small, protocol-faithful OpenID Connect provider for tests.

It runs as an aiohttp app inside the test process and speaks the parts of OIDC
the gateway uses: discovery, JWKS, the authorization-code flow with PKCE (S256)
and RS256 ID tokens. Tests can also mint arbitrary tokens, rotate the signing
key and choose the identity the next ``/authorize`` will log in.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

import jwt
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.asymmetric.rsa import RSAPrivateKey

from tests.conftest import free_port


def b64url(data: bytes) -> str:
    """Unpadded base64url, as JOSE and PKCE use it."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def new_rsa_key() -> RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@dataclass
class SigningKey:
    """One RSA key pair published in the JWKS under ``kid``."""

    kid: str
    private: RSAPrivateKey

    def jwk(self) -> dict[str, Any]:
        """The public half as a JWK (RFC 7517)."""
        numbers = self.private.public_key().public_numbers()
        as_bytes = lambda n: n.to_bytes((n.bit_length() + 7) // 8, "big")  # noqa: E731
        return {"kty": "RSA", "use": "sig", "alg": "RS256", "kid": self.kid,
                "n": b64url(as_bytes(numbers.n)), "e": b64url(as_bytes(numbers.e))}


@dataclass
class PendingCode:
    """An authorization code waiting for its ``/token`` exchange."""

    client_id: str
    redirect_uri: str
    code_challenge: str
    claims: dict[str, Any]


@dataclass
class OIDCProvider:
    """The test identity provider. ``await start()``, use ``url`` as issuer, ``await stop()``."""

    client_id: str = "gatewayd-test"
    client_secret: str = "s3cret"
    keys: list[SigningKey] = field(default_factory=list)
    codes: dict[str, PendingCode] = field(default_factory=dict)
    jwks_fetches: int = 0  # how often the JWKS was served, and when last (monotonic clock)
    last_jwks_fetch: float = 0.0
    # the identity the next /authorize logs in (there is no login page: the "user" is already signed in)
    user: dict[str, Any] = field(default_factory=lambda: {
        "sub": "flow-user", "email": "flow@example.com", "name": "Flo Flow", "groups": ["dev"]})
    # extra ``mint`` arguments for the ID tokens /token issues, to make a misbehaving provider (e.g. {"aud": "x"})
    id_token_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.rotate()
        self._runner: web.AppRunner | None = None

    # --- lifecycle --------------------------------------------------------------------------------------

    async def start(self) -> "OIDCProvider":
        app = web.Application()
        app.router.add_get("/.well-known/openid-configuration", self._discovery)
        app.router.add_get("/jwks", self._jwks)
        app.router.add_get("/authorize", self._authorize)
        app.router.add_post("/token", self._token)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    # --- test controls ----------------------------------------------------------------------------------

    @property
    def current(self) -> SigningKey:
        """The key new tokens are signed with (the last one added)."""
        return self.keys[-1]

    def rotate(self, keep_old: bool = True) -> SigningKey:
        """Start signing with a fresh key under a new kid; ``keep_old=False`` unpublishes the previous ones."""
        key = SigningKey(kid=f"key-{secrets.token_hex(4)}", private=new_rsa_key())
        self.keys = (self.keys if keep_old else []) + [key]
        return key

    def set_user(self, sub: str, email: str, name: str = "", groups: list[str] | None = None) -> None:
        """The claims the next ``/authorize`` puts in the ID token."""
        self.user = {"sub": sub, "email": email, "name": name, "groups": list(groups or [])}

    def mint(self, sub: str, email: str = "", name: str = "", groups: list[str] | None = None, *,
             aud: str | None = None, iss: str | None = None, exp_delta: float = 300, kid: str | None = None,
             key: RSAPrivateKey | None = None, **extra: Any) -> str:
        """An RS256 ID token. Defaults make a valid one; every knob exists to make an invalid one."""
        now = int(time.time())
        claims: dict[str, Any] = {"iss": iss if iss is not None else self.url,
                                  "aud": aud if aud is not None else self.client_id,
                                  "sub": sub, "iat": now, "exp": now + int(exp_delta), **extra}
        if email:
            claims["email"] = email
        if name:
            claims["name"] = name
        if groups is not None:
            claims["groups"] = groups
        return jwt.encode(claims, key or self.current.private, algorithm="RS256",
                          headers={"kid": kid if kid is not None else self.current.kid})

    # --- protocol endpoints -----------------------------------------------------------------------------

    async def _discovery(self, request: web.Request) -> web.Response:
        return web.json_response({
            "issuer": self.url,
            "authorization_endpoint": f"{self.url}/authorize",
            "token_endpoint": f"{self.url}/token",
            "jwks_uri": f"{self.url}/jwks",
            "response_types_supported": ["code"],
            "subject_types_supported": ["public"],
            "id_token_signing_alg_values_supported": ["RS256"],
            "code_challenge_methods_supported": ["S256"],
            "token_endpoint_auth_methods_supported": ["client_secret_post"],
        })

    async def _jwks(self, request: web.Request) -> web.Response:
        self.jwks_fetches += 1
        self.last_jwks_fetch = time.monotonic()
        return web.json_response({"keys": [k.jwk() for k in self.keys]})

    async def _authorize(self, request: web.Request) -> web.Response:
        """Validates the request and logs ``self.user`` in at once (no consent page)."""
        q = request.query
        if q.get("client_id") != self.client_id:
            return web.json_response({"error": "unauthorized_client"}, status=400)
        redirect_uri = q.get("redirect_uri", "")
        if not redirect_uri.startswith("http"):
            return web.json_response({"error": "invalid_request", "error_description": "redirect_uri"}, status=400)
        if q.get("response_type") != "code":
            return web.json_response({"error": "unsupported_response_type"}, status=400)
        if q.get("code_challenge_method") != "S256" or not q.get("code_challenge"):
            return web.json_response({"error": "invalid_request", "error_description": "PKCE S256 required"},
                                     status=400)
        if "openid" not in q.get("scope", "").split():
            return web.json_response({"error": "invalid_scope"}, status=400)
        code = secrets.token_urlsafe(24)
        self.codes[code] = PendingCode(self.client_id, redirect_uri, q["code_challenge"], dict(self.user))
        query = {"code": code, **({"state": q["state"]} if "state" in q else {})}
        raise web.HTTPFound(f"{redirect_uri}?{urlencode(query)}")

    async def _token(self, request: web.Request) -> web.Response:
        """The code exchange: one use per code, same client and redirect_uri, PKCE verifier must match."""
        form = await request.post()

        def error(kind: str, description: str, status: int = 400) -> web.Response:
            return web.json_response({"error": kind, "error_description": description}, status=status)

        if form.get("grant_type") != "authorization_code":
            return error("unsupported_grant_type", "only authorization_code")
        if form.get("client_id") != self.client_id or form.get("client_secret") != self.client_secret:
            return error("invalid_client", "bad client credentials", 401)
        pending = self.codes.pop(str(form.get("code", "")), None)
        if pending is None:
            return error("invalid_grant", "unknown or used code")
        if form.get("redirect_uri") != pending.redirect_uri:
            return error("invalid_grant", "redirect_uri mismatch")
        verifier = str(form.get("code_verifier", ""))
        if not verifier or b64url(hashlib.sha256(verifier.encode()).digest()) != pending.code_challenge:
            return error("invalid_grant", "PKCE verification failed")
        claims = pending.claims
        id_token = self.mint(claims["sub"], claims.get("email", ""), claims.get("name", ""), claims.get("groups"),
                             **self.id_token_options)
        return web.json_response({"id_token": id_token, "access_token": secrets.token_urlsafe(24),
                                  "token_type": "Bearer", "expires_in": 300})


def forge_unsigned(claims: dict[str, Any]) -> str:
    """An ``alg: none`` JWT: header and payload, empty signature."""
    header = b64url(json.dumps({"alg": "none", "typ": "JWT"}).encode())
    return f"{header}.{b64url(json.dumps(claims).encode())}."


def forge_hs256(claims: dict[str, Any], secret: bytes, kid: str) -> str:
    """An HS256 JWT with ``secret`` as the HMAC key (pyjwt refuses PEM secrets, so by hand)."""
    header = b64url(json.dumps({"alg": "HS256", "typ": "JWT", "kid": kid}).encode())
    signing_input = f"{header}.{b64url(json.dumps(claims).encode())}"
    signature = hmac.new(secret, signing_input.encode(), hashlib.sha256).digest()
    return f"{signing_input}.{b64url(signature)}"


def respellings(token: str) -> list[str]:
    """Other spellings of ``token``'s signature that a lenient decoder reads as the same bytes: padded (PyJWT
    takes it), half padded, the last character's unused bits set, a space inside."""
    head, claims, signature = token.split(".")
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    stray = alphabet[alphabet.index(signature[-1]) ^ 1]  # a signature of 64 or 256 bytes leaves 4 bits unused
    return [f"{head}.{claims}.{signature}" + "=" * (-len(signature) % 4), f"{head}.{claims}.{signature}=",
            f"{head}.{claims}.{signature[:-1]}{stray}", f"{head}.{claims}.{signature[:8]} {signature[8:]}"]
