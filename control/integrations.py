"""Cloud integrations: the organization's AWS access key and managed database discovery (admin only)."""

from __future__ import annotations

import base64
import re

from aiohttp import web

from control.connections import CONNECTION_OUT, build_connection, connection_json
from control.http import AUDIT_PAYLOAD, ApiError, Field, RouteSet, Schema, json_body, ok, require_admin, services_of
from control.schemas import STRINGS, TEXT
from gatewayd.discovery import ARN_TAG, ENGINE_SUBTYPES, AwsAccessKey, DiscoveryError
from gatewayd.discovery import ACCOUNT_ID as ACCOUNT_ID_SHAPE
from gatewayd.models import User
from gatewayd.store import Conflict

routes = RouteSet("Integrations", audit="integrations")

ACCESS_KEY = Schema("AwsAccessKey", {
    "access_key_id": Field("string", True), "secret_access_key": Field("string", True),
    "session_token": Field("string"), "region": Field("string", description="e.g. eu-west-1"),
})
DESCRIBE = Schema("DescribeDbInstances", {"account_ids": Field("array", True, items="string", min_length=1)})
FROM_INSTANCE = Schema("ConnectionFromDbInstance", {
    "name": Field("string", description="default: the instance identifier"),
    "user": Field("string", description="default: the instance's master user name"),
    "password": Field("string", True), "database": Field("string", description="default: the instance's DB name"),
    "sslmode": Field("string", description="the gateway's TLS to the instance; default require"),
    "reviewers": Field("array", items="string"), "tags": Field("object"),
})
_MASKED = {"access_key_id": TEXT, "region": TEXT, "session_token": Field("boolean", True)}
KEY_SET_OUT = Schema("AwsAccessKeySet", {"account_id": TEXT, **_MASKED})
KEY_OUT = Schema("AwsAccessKeyState", {
    "configured": Field("boolean", True), **{k: Field(v.type) for k, v in _MASKED.items()},
    "use_instance_role": Field("boolean", True), "regions": STRINGS})
INSTANCES_OUT = Schema("DbInstances", {"items": Field("array", True, items=Schema("DbInstance", {
    "account_id": TEXT, "arn": TEXT, "name": TEXT, "engine": TEXT, "status": TEXT, "availability_zone": TEXT,
    "vpc_id": TEXT, "connection_resources": STRINGS, "error": TEXT, "region": TEXT, "endpoint": TEXT,
    "port": Field("integer", True, minimum=0, maximum=65535)}))})
KEY_ID = re.compile(r"^[A-Z0-9]{16,128}$")
REGION = re.compile(r"^[a-z]{2}(-[a-z]+)+-\d{1,2}$")
MAX_ACCOUNTS = 100


def _discovery_error(exc: DiscoveryError) -> ApiError:
    return ApiError(exc.status, exc.message)


@routes.put("/integrations/aws/iam/accesskeys", "Set the organization's AWS access key (checked with STS, "
            "sealed at rest; the secret is never shown again)", body=ACCESS_KEY, response=KEY_SET_OUT)
async def put_access_key(request: web.Request) -> web.Response:
    admin = require_admin(request)
    body = await json_body(request, ACCESS_KEY)
    key = AwsAccessKey(access_key_id=body["access_key_id"].strip(), secret_access_key=body["secret_access_key"],
                       session_token=body.get("session_token") or "", region=(body.get("region") or "").strip())
    request[AUDIT_PAYLOAD] = key.masked()
    if not KEY_ID.match(key.access_key_id):
        raise ApiError(422, "field 'access_key_id': expected an AWS access key id (upper-case letters and digits)")
    if not key.secret_access_key.strip():
        raise ApiError(422, "field 'secret_access_key': must not be empty")
    discovery = services_of(request).discovery
    if key.region and not REGION.match(key.region):
        raise ApiError(422, f"field 'region': expected an AWS region such as eu-west-1, got {key.region!r}")
    if not key.region and not discovery.settings.regions:
        raise ApiError(400, "field 'region' is required: the gateway has no [integrations.aws] regions")
    try:
        account = await discovery.set_key(admin.org_id, key)
    except DiscoveryError as exc:
        raise _discovery_error(exc) from None
    return ok({"account_id": account, **key.masked()})


@routes.get("/integrations/aws/iam/accesskeys", "Whether the organization has an AWS access key (never its secret)",
            response=KEY_OUT)
async def get_access_key(request: web.Request) -> web.Response:
    admin = require_admin(request)
    discovery = services_of(request).discovery
    key = await discovery.key(admin.org_id)
    return ok({"configured": key is not None, **(key.masked() if key else {}),
               "use_instance_role": discovery.settings.use_instance_role, "regions": list(discovery.settings.regions)})


@routes.delete("/integrations/aws/iam/accesskeys", "Forget the organization's AWS access key", status=204)
async def delete_access_key(request: web.Request) -> web.Response:
    admin = require_admin(request)
    if not await services_of(request).discovery.clear_key(admin.org_id):
        raise ApiError(404, "this organization has no AWS access key")
    return web.Response(status=204)


async def _describe(request: web.Request) -> web.Response:
    admin = require_admin(request)
    body = await json_body(request, DESCRIBE)
    accounts = list(dict.fromkeys(a.strip() for a in body["account_ids"]))
    if not accounts:
        raise ApiError(422, "field 'account_ids': name at least one AWS account id")
    if len(accounts) > MAX_ACCOUNTS:
        raise ApiError(422, f"field 'account_ids': at most {MAX_ACCOUNTS} accounts a call")
    bad = [a for a in accounts if not ACCOUNT_ID_SHAPE.match(a)]
    if bad:
        raise ApiError(422, f"field 'account_ids': not a 12-digit AWS account id: {bad[0]!r}")
    try:
        items = await services_of(request).discovery.describe(admin.org_id, accounts, _host_identity(request, admin))
    except DiscoveryError as exc:
        raise _discovery_error(exc) from None
    request[AUDIT_PAYLOAD] = {"account_ids": accounts, "instances": sum(1 for i in items if not i.error),
                              "failed": {i.account_id: i.error for i in items if i.error}}
    return ok({"items": [item.as_json() for item in items]})


@routes.post("/integrations/aws/rds/describe-db-instances", "RDS instances of the given AWS accounts, in every "
             "configured region; an account that fails is one item with its error (the answer is still 200)",
             body=DESCRIBE, response=INSTANCES_OUT)
async def describe_rds(request: web.Request) -> web.Response:
    return await _describe(request)


@routes.post("/integrations/cloud/managed-db/describe-db-instances", "The specification's path: AWS RDS "
             "(same as /integrations/aws/rds/describe-db-instances)", body=DESCRIBE,
             response=INSTANCES_OUT)
async def describe_managed_db(request: web.Request) -> web.Response:
    return await _describe(request)


def _host_identity(request: web.Request, admin: User) -> bool:
    """May this caller's discovery use the gateway host's own AWS identity (``use_instance_role``)? Its operators
    only, in their own organization: a tenant's admin would otherwise list (and connect to) the host's account."""
    services = services_of(request)
    return services.identity.is_operator(admin) and not services.tenancy.is_tenant(admin.org_id)


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


@routes.post("/integrations/aws/rds/instances/{arn}/connection", "Create a PostgreSQL or MySQL/MariaDB connection "
             "from a discovered RDS instance (its endpoint, port and database filled in)", body=FROM_INSTANCE, status=201,
             response=CONNECTION_OUT)
async def connection_from_instance(request: web.Request) -> web.Response:
    admin = require_admin(request)
    body = await json_body(request, FROM_INSTANCE)
    request[AUDIT_PAYLOAD] = {"arn": request.match_info["arn"], "name": body.get("name")}
    services = services_of(request)
    try:
        instance = await services.discovery.instance(admin.org_id, request.match_info["arn"],
                                                    _host_identity(request, admin))
    except DiscoveryError as exc:
        raise _discovery_error(exc) from None
    if instance.engine not in ENGINE_SUBTYPES:
        raise ApiError(422, f"instance {instance.name} runs {instance.engine}: gatewayd proxies PostgreSQL and "
                            f"MySQL/MariaDB ({', '.join(sorted(ENGINE_SUBTYPES))}) only")
    subtype, default_port, default_database = ENGINE_SUBTYPES[instance.engine]
    if not instance.endpoint:
        raise ApiError(409, f"instance {instance.name} has no endpoint yet (status {instance.status})")
    user = body.get("user") or instance.master_username
    if not user:
        raise ApiError(400, "field 'user' is required: the instance does not name a master user")
    secret = {"envvar:HOST": _b64(instance.endpoint), "envvar:PORT": _b64(str(instance.port or default_port)),
              "envvar:USER": _b64(user), "envvar:PASS": _b64(body["password"]),
              "envvar:DB": _b64(body.get("database") or instance.database or default_database),
              "envvar:SSLMODE": _b64(body.get("sslmode") or "require")}
    tags = {**{str(k): str(v) for k, v in (body.get("tags") or {}).items()}, ARN_TAG: instance.arn,
            "aws_account_id": instance.account_id, "aws_region": instance.region}
    fields = {"name": body.get("name") or instance.name, "type": "database", "subtype": subtype,
              "secret": secret, "tags": tags}
    if body.get("reviewers") is not None:
        fields["reviewers"] = body["reviewers"]
    connection = build_connection(fields, admin.org_id, fields["name"], None)
    try:
        await services.store.create_connection(connection)
    except Conflict:
        raise ApiError(409, f"connection {connection.name!r} already exists") from None
    return ok(connection_json(connection, admin), status=201)
