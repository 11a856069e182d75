"""Cloud database discovery end to end: a real gatewayd asks a local AWS (moto's server, with IAM
enforced) through aiobotocore.

Three accounts: the key's own (two PostgreSQL instances in us-east-1, a MySQL one in eu-west-1), a
second one reached by assuming its OrganizationAccountAccessRole (105 instances: more than one
page), and a third whose role the key may not assume (AccessDenied).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import urllib.parse
from pathlib import Path

import aiohttp
import pytest

from gatewayd.discovery import ENGINE_SUBTYPES
from aiobotocore.session import get_session

from tests.apiclient import Api, admin_http, b64
from tests.conftest import BIN, Daemon, free_port, wait_port

OWN, OTHER, DENIED = "123456789012", "222222222222", "333333333333"
ROLE = "OrganizationAccountAccessRole"
SETUP_KEY = {"aws_access_key_id": "AKIAIOSFODNN7SETUP00", "aws_secret_access_key": "setup" * 8}
MANY = 105


async def _moto(endpoint: str, path: str, data: bytes = b"") -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(endpoint + path, data=data) as response:
            assert response.status == 200, await response.text()


async def _populate(endpoint: str) -> dict[str, str]:
    """The three accounts as described above; the gateway's IAM user key (its secret included)."""
    session = get_session()

    def client(service: str, region: str = "us-east-1", **credentials: str):
        return session.create_client(service, region_name=region, endpoint_url=endpoint,
                                     **(credentials or SETUP_KEY))

    async with client("iam") as iam:
        await iam.create_user(UserName="gatewayd")
        await iam.put_user_policy(UserName="gatewayd", PolicyName="discovery", PolicyDocument=json.dumps({
            "Version": "2012-10-17", "Statement": [
                {"Effect": "Allow", "Action": ["rds:DescribeDBInstances", "sts:GetCallerIdentity"], "Resource": "*"},
                {"Effect": "Allow", "Action": "sts:AssumeRole", "Resource": f"arn:aws:iam::{OTHER}:role/*"}]}))
        key = (await iam.create_access_key(UserName="gatewayd"))["AccessKey"]
    async with client("rds") as rds:
        for name in ("orders", "billing"):
            await rds.create_db_instance(DBInstanceIdentifier=name, Engine="postgres", DBInstanceClass="db.t3.micro",
                                         MasterUsername="master", MasterUserPassword="password1",
                                         AllocatedStorage=20, DBName=name)
    async with client("rds", "eu-west-1") as rds:
        await rds.create_db_instance(DBInstanceIdentifier="legacy", Engine="mysql", DBInstanceClass="db.t3.micro",
                                     MasterUsername="master", MasterUserPassword="password1", AllocatedStorage=20)
        await rds.create_db_instance(DBInstanceIdentifier="ledger", Engine="oracle-ee", LicenseModel="bring-your-own-license",
                                     DBInstanceClass="db.t3.micro", MasterUsername="master",
                                     MasterUserPassword="password1", AllocatedStorage=20)
    async with client("sts") as sts:
        assumed = (await sts.assume_role(RoleArn=f"arn:aws:iam::{OTHER}:role/{ROLE}",
                                         RoleSessionName="setup"))["Credentials"]
    other = {"aws_access_key_id": assumed["AccessKeyId"], "aws_secret_access_key": assumed["SecretAccessKey"],
             "aws_session_token": assumed["SessionToken"]}
    async with client("iam", **other) as iam:
        await iam.create_role(RoleName=ROLE, AssumeRolePolicyDocument=json.dumps({
            "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "sts:AssumeRole",
                                                    "Principal": {"AWS": f"arn:aws:iam::{OWN}:root"}}]}))
        await iam.put_role_policy(RoleName=ROLE, PolicyName="all", PolicyDocument=json.dumps({
            "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
    async with client("rds", **other) as rds:
        for number in range(MANY):
            await rds.create_db_instance(DBInstanceIdentifier=f"tenant-{number:03d}", Engine="postgres",
                                         DBInstanceClass="db.t3.micro", MasterUsername="master",
                                         MasterUserPassword="password1", AllocatedStorage=20)
    await _moto(endpoint, "/moto-api/reset-auth", b"0")  # from now on every call is checked against IAM
    return {"access_key_id": key["AccessKeyId"], "secret_access_key": key["SecretAccessKey"]}


@pytest.fixture(scope="module")
async def aws(tmp_path_factory):
    port = free_port()
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "wb")
    process = subprocess.Popen([str(BIN / "moto_server"), "-p", str(port)], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_port(port, process, "moto_server")
        endpoint = f"http://127.0.0.1:{port}"
        yield endpoint, await _populate(endpoint)
    finally:
        process.terminate()
        process.wait(10)
        log.close()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, aws):
    endpoint, _ = aws
    daemon = Daemon(tmp_path_factory.mktemp("discovery") / "data", {
        "integrations.aws.endpoint_url": endpoint, "integrations.aws.regions": ["us-east-1", "eu-west-1"],
        "integrations.aws.timeout": "10s"}).start()
    yield daemon
    assert daemon.stop() == 0


@pytest.fixture(scope="module")
async def api(gateway):
    async with admin_http(gateway) as http:
        yield Api(gateway, http)


async def describe(api: Api, *accounts: str) -> tuple[int, dict]:
    return await api("POST", "/integrations/aws/rds/describe-db-instances", {"account_ids": list(accounts)})


async def test_without_a_key_or_with_a_refused_one_the_admin_is_told_what_to_set(api, aws):
    status, body = await describe(api, OWN)
    assert status == 400 and "PUT /api/integrations/aws/iam/accesskeys" in body["message"]
    status, body = await api("PUT", "/integrations/aws/iam/accesskeys", {
        "access_key_id": aws[1]["access_key_id"], "secret_access_key": "not-the-secret" * 3, "region": "us-east-1"})
    assert status == 400 and "AWS refused the access key" in body["message"] and "SignatureDoesNotMatch" in body["message"]
    status, body = await api("PUT", "/integrations/aws/iam/accesskeys", {"access_key_id": "AKIA1234567890ABCD"})
    assert status == 400 and "secret_access_key" in body["message"]
    status, body = await api("PUT", "/integrations/aws/iam/accesskeys", {
        "access_key_id": aws[1]["access_key_id"], "secret_access_key": "x", "region": "mars"})
    assert status == 422 and "region" in body["message"]
    status, body = await api("GET", "/integrations/aws/iam/accesskeys")
    assert status == 200 and body["configured"] is False


async def test_accounts_are_discovered_with_paging_and_a_denied_account_is_one_item(api, aws, gateway):
    status, body = await api("PUT", "/integrations/aws/iam/accesskeys", {**aws[1], "region": "us-east-1"})
    assert status == 200 and body["account_id"] == OWN, body
    assert body["access_key_id"].endswith(aws[1]["access_key_id"][-4:]) and "secret_access_key" not in body

    status, body = await describe(api, OWN, OTHER, DENIED)
    assert status == 200, body
    items = body["items"]
    by_account: dict[str, list[dict]] = {}
    for item in items:
        by_account.setdefault(item["account_id"], []).append(item)
    own = {i["name"]: i for i in by_account[OWN]}
    assert set(own) == {"orders", "billing", "legacy", "ledger"} and all(not i["error"] for i in own.values())
    assert own["orders"]["engine"] == "postgres" and own["legacy"]["engine"] == "mysql"
    assert own["legacy"]["availability_zone"].startswith("eu-west-1") and own["legacy"]["region"] == "eu-west-1"
    assert own["orders"]["arn"] == f"arn:aws:rds:us-east-1:{OWN}:db:orders"
    assert set(own["orders"]) >= {"account_id", "arn", "name", "engine", "status", "availability_zone", "vpc_id",
                                  "connection_resources", "error"}
    assert len({i["name"] for i in by_account[OTHER]}) == MANY  # more than one page of 100
    assert all(i["arn"].startswith(f"arn:aws:rds:us-east-1:{OTHER}:db:") for i in by_account[OTHER])
    (denied,) = by_account[DENIED]
    assert "AccessDenied" in denied["error"] and f"arn:aws:iam::{DENIED}:role/{ROLE}" in denied["error"]
    assert denied["arn"] == "" and denied["name"] == ""

    status, logs = await api("GET", "/audit/logs?action=integrations.describe_rds&page_size=5")
    entry = logs["data"][0]
    assert entry["outcome"] == "success" and entry["request_payload_redacted"]["account_ids"] == [OWN, OTHER, DENIED]
    assert entry["request_payload_redacted"]["instances"] == 4 + MANY
    assert list(entry["request_payload_redacted"]["failed"]) == [DENIED]

    status, body = await api("POST", "/integrations/cloud/managed-db/describe-db-instances", {"account_ids": [OWN]})
    assert status == 200 and len(body["items"]) == 4  # the specification's literal path
    for bad in ([], ["12345"], ["abcdefghijkl"]):
        status, body = await describe(api, *bad)
        assert status == 422, body


async def test_connections_are_mapped_and_made_from_an_instance(api, aws):
    status, body = await describe(api, OWN)
    orders = next(i for i in body["items"] if i["name"] == "orders")
    assert orders["connection_resources"] == []
    by_host = await api.connection("orders-by-host", "database", "postgres", {
        "HOST": orders["endpoint"].upper(), "PORT": str(orders["port"]), "USER": "u", "PASS": "p"})
    status, made = await api("POST", f"/integrations/aws/rds/instances/{urllib.parse.quote(orders['arn'], safe='')}"
                                     "/connection", {"name": "orders-rds", "password": "the-db-password"})
    assert status == 201, made
    assert made["subtype"] == "postgres" and made["tags"]["aws_arn"] == orders["arn"]
    status, full = await api("GET", "/connections/orders-rds")
    assert full["secret"]["envvar:PASS"] == "[REDACTED]"  # the password given is never shown again
    secret = {k: __import__("base64").b64decode(v).decode() for k, v in full["secret"].items() if k != "envvar:PASS"}
    assert secret["envvar:HOST"] == orders["endpoint"] and secret["envvar:DB"] == "orders"
    assert secret["envvar:USER"] == "master" and secret["envvar:PORT"] == str(orders["port"])

    status, body = await describe(api, OWN)
    orders = next(i for i in body["items"] if i["name"] == "orders")
    assert orders["connection_resources"] == sorted([by_host["name"], "orders-rds"])
    assert next(i for i in body["items"] if i["name"] == "billing")["connection_resources"] == []

    legacy = next(i for i in body["items"] if i["name"] == "legacy")  # MySQL: the mysql proxy's
    status, made = await api("POST", f"/integrations/aws/rds/instances/{legacy['arn']}/connection", {"password": "x"})
    assert status == 201 and made["subtype"] == "mysql", made
    status, full = await api("GET", f"/connections/{made['name']}")
    secret = {k: __import__("base64").b64decode(v).decode() for k, v in full["secret"].items() if k != "envvar:PASS"}
    assert secret["envvar:PORT"] == str(legacy["port"] or 3306) and secret["envvar:DB"] == "", secret
    # MariaDB and Aurora MySQL too (moto's RDS has no mariadb engine to make an instance of)
    assert {ENGINE_SUBTYPES[e][0] for e in ("mariadb", "aurora-mysql", "mysql")} == {"mysql"}
    ledger = next(i for i in body["items"] if i["name"] == "ledger")
    status, answer = await api("POST", f"/integrations/aws/rds/instances/{ledger['arn']}/connection",
                               {"password": "x"})
    assert status == 422 and "oracle-ee" in answer["message"]
    status, answer = await api("POST", f"/integrations/aws/rds/instances/arn:aws:rds:us-east-1:{OWN}:db:nope"
                                       "/connection", {"password": "x"})
    assert status == 404
    status, answer = await api("POST", "/integrations/aws/rds/instances/not-an-arn/connection", {"password": "x"})
    assert status == 422


async def test_the_secret_key_is_sealed_and_never_shown_and_can_be_cleared(api, aws, gateway):
    status, _ = await api("PUT", "/integrations/aws/iam/accesskeys", {**aws[1], "region": "us-east-1"})
    assert status == 200
    secret = aws[1]["secret_access_key"].encode()
    for path in Path(gateway.data_dir).rglob("*"):
        if path.is_file():
            assert secret not in path.read_bytes(), path
    assert secret.decode() not in gateway.log_text()
    status, logs = await api("GET", "/audit/logs?resource_type=integrations&page_size=100")
    assert secret.decode() not in json.dumps(logs)
    status, shown = await api("GET", "/integrations/aws/iam/accesskeys")
    assert shown["configured"] and secret.decode() not in json.dumps(shown)

    user_token = gateway.token("someone@example.com", groups="")
    status, _ = await api("POST", "/integrations/aws/rds/describe-db-instances", {"account_ids": [OWN]},
                          token=user_token)
    assert status == 403

    status, _ = await api("DELETE", "/integrations/aws/iam/accesskeys")
    assert status == 204
    status, body = await describe(api, OWN)
    assert status == 400
    status, _ = await api("DELETE", "/integrations/aws/iam/accesskeys")
    assert status == 404


async def test_the_hosts_own_aws_identity_serves_operators_only_in_multi_tenant_mode(aws, tmp_path):
    """Issue 31, item 5: with ``use_instance_role = true``, a self-service organization's discovery ran as the
    gateway host's own AWS identity (its accounts' instances listed to, and connectable by, any tenant)."""
    from tests.oidc_provider import OIDCProvider

    endpoint, key = aws
    idp = await OIDCProvider().start()
    daemon = Daemon(tmp_path / "data", {
        "integrations.aws.endpoint_url": endpoint, "integrations.aws.regions": ["us-east-1"],
        "integrations.aws.timeout": "10s", "integrations.aws.use_instance_role": True, "auth.multi_tenant": True,
        "auth.issuer": "oidc", "auth.oidc.issuer_url": idp.url, "auth.oidc.client_id": idp.client_id,
        "auth.oidc.client_secret": idp.client_secret})
    # the host's identity: the default credential chain's environment variables
    daemon.extra_env.update({"AWS_ACCESS_KEY_ID": key["access_key_id"], "AWS_SECRET_ACCESS_KEY": key["secret_access_key"],
                             "AWS_EC2_METADATA_DISABLED": "true"})
    await asyncio.to_thread(daemon.start)  # the identity provider answers on this loop meanwhile
    try:
        async with aiohttp.ClientSession() as http:
            founder = idp.mint("tenant-founder", "founder@tenant.example", "Founder", None, email_verified=True)
            api = Api(daemon, http, founder)
            status, body = await api("POST", "/signup", {"org_name": "a tenant"})
            assert status == 201, body
            status, body = await describe(api, OWN)
            assert status == 403 and "PUT /api/integrations/aws/iam/accesskeys" in body["message"], body
            arn = urllib.parse.quote(f"arn:aws:rds:us-east-1:{OWN}:db:orders", safe="")
            status, body = await api("POST", f"/integrations/aws/rds/instances/{arn}/connection", {"password": "x"})
            assert status == 403, body
            # an admin of the operators' organization who is no operator neither
            admin = (await asyncio.to_thread(daemon.cli, "token", "create", "--email", "admin@ops.example",
                                             "--groups", "admin")).stdout.strip()
            assert (await describe(Api(daemon, http, admin), OWN))[0] == 403
            # the operator, on the host's own identity
            operator = (await asyncio.to_thread(daemon.cli, "token", "create", "--email", "root@ops.example",
                                                "--groups", "admin", "--operator")).stdout.strip()
            status, body = await describe(Api(daemon, http, operator), OWN)
            assert status == 200 and {i["name"] for i in body["items"]} == {"orders", "billing"}, body
    finally:
        await asyncio.to_thread(daemon.stop)
        await idp.stop()
