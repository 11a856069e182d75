"""Cloud database discovery: the managed database instances an organization's AWS accounts hold.

An admin gives the gateway an AWS access key per organization (sealed at rest by the master key,
like every secret), or the host's own credential chain is used when the configuration allows it.
``describe`` asks STS who that key is, queries that account directly and every other requested
account through ``AssumeRole`` of a configured role, pages through RDS ``DescribeDBInstances`` in
each configured region, and answers one item per instance. One account or region failing is one
item with an ``error``: the others' instances are still answered.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator

from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

from gatewayd.models import Connection, target_port

if TYPE_CHECKING:
    from gatewayd.store import Store

log = logging.getLogger("gatewayd.discovery")

ACCOUNT_ID = re.compile(r"^\d{12}$")
RDS_ARN = re.compile(r"^arn:(?P<partition>aws[a-z-]*):rds:(?P<region>[a-z0-9-]+):(?P<account>\d{12}):db:"
                     r"(?P<name>[A-Za-z][A-Za-z0-9-]{0,62})$")
REFUSED_KEY_CODES = {"InvalidClientTokenId", "SignatureDoesNotMatch", "UnrecognizedClientException",
                     "ExpiredToken", "AuthFailure", "InvalidAccessKeyId"}
ARN_TAG = "aws_arn"  # a connection tag naming the instance it points at
MAX_PARALLEL = 8  # accounts and regions queried at once
POSTGRES_ENGINES = {"postgres", "aurora-postgresql"}
MYSQL_ENGINES = {"mysql", "mariadb", "aurora-mysql", "aurora"}  # "aurora": Aurora MySQL 5.6's engine name
# an RDS engine -> the connection subtype that proxies it, its default port and default database
ENGINE_SUBTYPES = {**{engine: ("postgres", 5432, "postgres") for engine in POSTGRES_ENGINES},
                   **{engine: ("mysql", 3306, "") for engine in MYSQL_ENGINES}}


class DiscoveryError(Exception):
    """A request that cannot be served as configured; ``message`` says what to set (no secret in it)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(slots=True)
class AwsAccessKey:
    """An organization's AWS access key (``secret_access_key`` and ``session_token`` are secrets)."""

    access_key_id: str
    secret_access_key: str
    region: str
    session_token: str = ""

    def client_args(self) -> dict[str, str]:
        args = {"aws_access_key_id": self.access_key_id, "aws_secret_access_key": self.secret_access_key}
        if self.session_token:
            args["aws_session_token"] = self.session_token
        return args

    def masked(self) -> dict[str, Any]:
        """What the API may show: the key id with all but its last four characters hidden, no secret."""
        return {"access_key_id": "*" * max(len(self.access_key_id) - 4, 0) + self.access_key_id[-4:],
                "region": self.region, "session_token": bool(self.session_token)}


@dataclass(slots=True)
class DatabaseInstance:
    """One discovered instance (the specification's Database instance, plus where to reach it)."""

    account_id: str
    arn: str = ""
    name: str = ""
    engine: str = ""
    status: str = ""
    availability_zone: str = ""
    vpc_id: str = ""
    connection_resources: list[str] = field(default_factory=list)
    error: str = ""
    region: str = ""
    endpoint: str = ""
    port: int = 0
    database: str = ""
    master_username: str = ""

    def as_json(self) -> dict[str, Any]:
        return {"account_id": self.account_id, "arn": self.arn, "name": self.name, "engine": self.engine,
                "status": self.status, "availability_zone": self.availability_zone, "vpc_id": self.vpc_id,
                "connection_resources": self.connection_resources, "error": self.error, "region": self.region,
                "endpoint": self.endpoint, "port": self.port}


@dataclass(slots=True, frozen=True)
class AwsSettings:
    """``[integrations.aws]`` of the configuration."""

    use_instance_role: bool = False
    regions: tuple[str, ...] = ()
    assume_role_name: str = "OrganizationAccountAccessRole"
    endpoint_url: str = ""
    timeout: float = 20.0


def _key_name(org_id: str) -> str:
    return f"aws-access-key:{org_id}"


def _failure(exc: Exception) -> str:
    """An AWS error as one line an admin can act on (AWS never puts a secret key in its messages)."""
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        return f"{error.get('Code', 'error')}: {error.get('Message', '')}".strip()
    return str(exc) or type(exc).__name__


def _instance(account_id: str, region: str, raw: dict[str, Any]) -> DatabaseInstance:
    endpoint = raw.get("Endpoint") or {}
    return DatabaseInstance(
        account_id=account_id, arn=raw.get("DBInstanceArn", ""), name=raw.get("DBInstanceIdentifier", ""),
        engine=raw.get("Engine", ""), status=raw.get("DBInstanceStatus", ""),
        availability_zone=raw.get("AvailabilityZone", ""), vpc_id=(raw.get("DBSubnetGroup") or {}).get("VpcId", ""),
        region=region, endpoint=endpoint.get("Address", ""), port=int(endpoint.get("Port") or 0),
        database=raw.get("DBName") or "", master_username=raw.get("MasterUsername") or "")


def connections_pointing_at(instance: DatabaseInstance, connections: list[Connection]) -> list[str]:
    """Names of the connections whose target is this instance (endpoint host and port, or an ``aws_arn`` tag)."""
    names = []
    for connection in connections:
        if instance.arn and connection.tags.get(ARN_TAG) == instance.arn:
            names.append(connection.name)
            continue
        target = connection.target()
        host = (target.get("HOST") or "").strip().rstrip(".").lower()
        if host and instance.endpoint and host == instance.endpoint.lower():
            if not instance.port or target_port(target, instance.port) == instance.port:
                names.append(connection.name)
    return sorted(names)


class AwsDiscovery:
    """Keys per organization and the RDS inventory of their accounts."""

    def __init__(self, store: Store, settings: AwsSettings) -> None:
        self.store = store
        self.settings = settings
        self._aws: tuple[Any, Any] | None = None  # aiobotocore's session and config, made on first use

    # -- the organization's key

    async def key(self, org_id: str) -> AwsAccessKey | None:
        material = await self.store.get_key(_key_name(org_id))
        return AwsAccessKey(**json.loads(material)) if material else None

    async def set_key(self, org_id: str, key: AwsAccessKey) -> str:
        """Check the key with STS, then keep it sealed; the account id it belongs to."""
        account = await self._caller_account(key.client_args(), key.region)
        await self.store.put_key(_key_name(org_id), json.dumps({
            "access_key_id": key.access_key_id, "secret_access_key": key.secret_access_key,
            "session_token": key.session_token, "region": key.region}).encode())
        return account

    async def clear_key(self, org_id: str) -> bool:
        return await self.store.delete_key(_key_name(org_id))

    async def source(self, org_id: str, host_identity: bool = True) -> tuple[dict[str, str], list[str]]:
        """(client credentials, regions) for an organization; a DiscoveryError says what is missing.
        ``host_identity``: whether the caller may use the host's own AWS identity (``use_instance_role``) when the
        organization has no key -- not a tenant's admin, whose calls would act as the gateway's host."""
        key = await self.key(org_id)
        if key is not None:
            credentials = key.client_args()
        elif self.settings.use_instance_role and not host_identity:
            raise DiscoveryError(403, "no AWS credentials for this organization: set them with PUT "
                                      "/api/integrations/aws/iam/accesskeys (the gateway host's own AWS identity "
                                      "serves its operators only)")
        elif self.settings.use_instance_role:
            credentials = {}  # the host's default chain: environment, shared files, instance metadata
        else:
            raise DiscoveryError(400, "no AWS credentials for this organization: set them with PUT "
                                      "/api/integrations/aws/iam/accesskeys, or set "
                                      "[integrations.aws] use_instance_role = true on the gateway")
        regions = list(self.settings.regions) or ([key.region] if key is not None and key.region else [])
        if not regions:
            raise DiscoveryError(400, "no AWS region: set region with PUT /api/integrations/aws/iam/accesskeys, "
                                      "or [integrations.aws] regions on the gateway")
        return credentials, regions

    # -- AWS calls

    def _client(self, service: str, region: str, credentials: dict[str, str]) -> Any:
        extra = {"endpoint_url": self.settings.endpoint_url} if self.settings.endpoint_url else {}
        if self._aws is None:  # aiobotocore is imported here: the CLI and a daemon that never asks AWS skip it
            from aiobotocore.config import AioConfig
            from aiobotocore.session import get_session

            self._aws = get_session(), AioConfig(connect_timeout=self.settings.timeout,
                                                    read_timeout=self.settings.timeout,
                                                    retries={"max_attempts": 3, "mode": "standard"})
        session, config = self._aws
        return session.create_client(service, region_name=region, config=config, **credentials, **extra)

    async def _caller_account(self, credentials: dict[str, str], region: str) -> str:
        try:
            async with self._client("sts", region or "us-east-1", credentials) as sts:
                return (await sts.get_caller_identity())["Account"]
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if code in REFUSED_KEY_CODES:
                raise DiscoveryError(400, f"AWS refused the access key ({_failure(exc)}): set a valid key with "
                                          "PUT /api/integrations/aws/iam/accesskeys") from None
            raise DiscoveryError(502, f"AWS STS answered an error: {_failure(exc)}") from None
        except NoCredentialsError:
            raise DiscoveryError(400, "the gateway host has no AWS credentials (use_instance_role): set a key with "
                                      "PUT /api/integrations/aws/iam/accesskeys") from None
        except BotoCoreError as exc:
            raise DiscoveryError(502, f"AWS could not be reached: {exc}") from None

    async def _account_credentials(self, own: str, account_id: str, credentials: dict[str, str],
                                   region: str) -> dict[str, str]:
        if account_id == own:
            return credentials
        role = f"arn:aws:iam::{account_id}:role/{self.settings.assume_role_name}"
        try:
            async with self._client("sts", region, credentials) as sts:
                assumed = (await sts.assume_role(RoleArn=role, RoleSessionName="gatewayd-discovery"))["Credentials"]
        except (ClientError, BotoCoreError) as exc:
            raise LookupError(f"could not assume {role}: {_failure(exc)}") from None
        return {"aws_access_key_id": assumed["AccessKeyId"], "aws_secret_access_key": assumed["SecretAccessKey"],
                "aws_session_token": assumed["SessionToken"]}

    async def _instances(self, account_id: str, region: str,
                         credentials: dict[str, str], **filters: Any) -> AsyncIterator[DatabaseInstance]:
        async with self._client("rds", region, credentials) as rds:
            async for page in rds.get_paginator("describe_db_instances").paginate(**filters):
                for raw in page.get("DBInstances", []):
                    yield _instance(account_id, region, raw)

    # -- what the API asks

    async def describe(self, org_id: str, account_ids: list[str], host_identity: bool = True) -> list[DatabaseInstance]:
        """Every instance of ``account_ids`` in the configured regions; a failure is an item with ``error``."""
        credentials, regions = await self.source(org_id, host_identity)
        own = await self._caller_account(credentials, regions[0])
        limit = asyncio.Semaphore(MAX_PARALLEL)

        async def one_account(account_id: str) -> list[DatabaseInstance]:
            async with limit:
                try:
                    account_credentials = await self._account_credentials(own, account_id, credentials, regions[0])
                except LookupError as exc:
                    return [DatabaseInstance(account_id=account_id, error=str(exc))]
            found = await asyncio.gather(*(one_region(account_id, region, account_credentials) for region in regions))
            return [item for items in found for item in items]

        async def one_region(account_id: str, region: str, account_credentials: dict[str, str]) -> list[DatabaseInstance]:
            async with limit:
                try:
                    return [i async for i in self._instances(account_id, region, account_credentials)]
                except (ClientError, BotoCoreError) as exc:
                    return [DatabaseInstance(account_id=account_id, region=region,
                                             error=f"region {region}: {_failure(exc)}")]

        results = await asyncio.gather(*(one_account(a) for a in account_ids))
        items = [item for items in results for item in items]
        connections = await self.store.list_connections(org_id)
        for item in items:
            if not item.error:
                item.connection_resources = connections_pointing_at(item, connections)
        return items

    async def instance(self, org_id: str, arn: str, host_identity: bool = True) -> DatabaseInstance:
        """The instance an ARN names (for making a connection from it); DiscoveryError when it cannot be read."""
        parts = RDS_ARN.match(arn)
        if parts is None:
            raise DiscoveryError(422, f"not an RDS DB instance ARN: {arn!r} (arn:aws:rds:REGION:ACCOUNT:db:NAME)")
        credentials, regions = await self.source(org_id, host_identity)
        own = await self._caller_account(credentials, regions[0])
        try:
            account_credentials = await self._account_credentials(own, parts["account"], credentials,
                                                                   parts["region"])
            async for found in self._instances(parts["account"], parts["region"], account_credentials,
                                               DBInstanceIdentifier=parts["name"]):
                return found
        except LookupError as exc:
            raise DiscoveryError(502, str(exc)) from None
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") == "DBInstanceNotFound":
                raise DiscoveryError(404, f"no RDS instance {arn}") from None
            raise DiscoveryError(502, f"AWS RDS answered an error: {_failure(exc)}") from None
        except BotoCoreError as exc:
            raise DiscoveryError(502, f"AWS could not be reached: {exc}") from None
        raise DiscoveryError(404, f"no RDS instance {arn}")
