"""The ``gatewayd`` command's host commands: mint tokens, manage local users, verify recordings and the audit log.

The command itself is ``launcher.cli:main`` (the composition root): it
registers the protocols and adds ``run``, then hands over to ``main`` here.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import os
import sys
from typing import Any, Awaitable, Callable, Coroutine, TypeVar

from gatewayd import __version__
from gatewayd.config import Config, ConfigError, load_config, parse_duration
from gatewayd.store import StoreError, describe


def load(path: str | None) -> Config:
    return load_config(path or os.environ.get("GATEWAYD_CONFIG") or None)


T = TypeVar("T")


def run_loop(coro: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    else:
        return uvloop.run(coro)


def _where(config: Config) -> str:
    """Where the configuration came from, to say where a command looked."""
    source = f"--config {config.source}" if config.source else "the embedded defaults"
    if os.environ.get("GATEWAYD_DATA_DIR"):
        source += " and $GATEWAYD_DATA_DIR"
    return source


async def _with_core(config: Config, action):  # type: ignore[no-untyped-def]
    """Run ``action`` on the core services of the gateway whose store the configuration names. A command never
    creates a store: a token minted into a new one would be refused by the running daemon."""
    from gatewayd.daemon import Gateway

    if config["store.driver"] == "sqlite" and not config.store_path.is_file():
        raise ConfigError(f"no gateway store at {config.store_path.resolve()} (data_dir from {_where(config)}): "
                          "run this on the gateway's host with its --config or GATEWAYD_DATA_DIR, "
                          "after `gatewayd run` has started once")
    gateway = Gateway(config)
    await gateway.open_core()
    try:
        return await action(gateway)
    finally:
        await gateway.close_core()


def _check_email(email: str) -> None:
    from gatewayd.models import email_problem

    if problem := email_problem(email):
        raise ConfigError(f"--email {email!r}: {problem}")


def _cmd_token_create(args: argparse.Namespace) -> int:
    _check_email(args.email)
    config = load(args.config)
    ttl = parse_duration(args.ttl, "--ttl") if args.ttl else config["auth.token_ttl"]
    if ttl <= 0:
        raise ConfigError("--ttl: must be positive")
    groups = [g.strip() for g in args.groups.split(",") if g.strip()] if args.groups is not None else None

    async def action(gateway):  # type: ignore[no-untyped-def]
        user = await gateway.identity.ensure_local_user(args.email, args.name or "", groups, args.operator)
        if user.status != "active":
            raise ConfigError(f"user {args.email} is inactive")
        await gateway.audit.record(org_id=user.org_id, actor=user, action="token.create", resource_type="token",
                                   outcome="success", payload={"email": args.email, "groups": groups,
                                                               "operator": user.operator,
                                                               "ttl_seconds": ttl, "via": "cli"})
        return gateway.identity.issue_token(user, ttl)

    print(asyncio.run(_with_core(config, action)))
    return 0


def _cmd_user_passwd(args: argparse.Namespace) -> int:
    from gatewayd.crypto import MIN_PASSWORD_LENGTH, hash_password

    _check_email(args.email)
    config = load(args.config)
    if args.password_stdin:
        password = sys.stdin.readline().rstrip("\n")
    elif not sys.stdin.isatty():
        raise ConfigError("no terminal to ask for the password: use --password-stdin and pipe it in")
    else:
        try:
            password = getpass.getpass("new password: ")
        except EOFError:
            raise ConfigError("no password given: use --password-stdin and pipe it in") from None
    if len(password) < MIN_PASSWORD_LENGTH:
        raise ConfigError(f"password: at least {MIN_PASSWORD_LENGTH} characters")

    async def action(gateway):  # type: ignore[no-untyped-def]
        user = await gateway.identity.ensure_local_user(args.email, args.name or "",
                                                        [g for g in (args.groups or "").split(",") if g] or None,
                                                        args.operator)
        user.password_hash = hash_password(password)
        await gateway.store.save_user(user)
        await gateway.identity.revoke_tokens_of(user)  # the tokens issued under the old password end with it

    asyncio.run(_with_core(config, action))
    print(f"password set for {args.email}", file=sys.stderr)
    return 0


def _cmd_user_operator(args: argparse.Namespace) -> int:
    if args.email:
        _check_email(args.email)
    config = load(args.config)
    named = f"--email {args.email}" if args.email else f"--subject {args.subject}"

    async def action(gateway):  # type: ignore[no-untyped-def]
        # by e-mail, the host's own user (the default organization's): never one a tenant made with that e-mail
        user = await (gateway.store.get_user(email=args.email, org_id=(await gateway.store.default_org()).id)
                      if args.email else gateway.store.get_user(subject=args.subject))
        if user is None:
            raise ConfigError(f"{named}: no such user in {describe(config)}")
        user.operator = not args.revoke
        await gateway.store.save_user(user)
        await gateway.audit.record(org_id=user.org_id or (await gateway.store.default_org()).id, actor=None,
                                   actor_hint="gatewayd user operator (host)", action="user.operator",
                                   resource_type="users", outcome="success",
                                   payload={"email": user.email, "operator": user.operator, "via": "cli"})

    asyncio.run(_with_core(config, action))
    print(f"{args.email or args.subject} is {'no longer ' if args.revoke else ''}an operator", file=sys.stderr)
    return 0


def _age(moment: str | None) -> str:
    from gatewayd.models import parse_time, utcnow

    when = parse_time(moment) if moment else None
    if when is None:
        return "-"
    seconds = max((utcnow() - when).total_seconds(), 0)
    return f"{seconds:.0f}s ago" if seconds < 120 else f"{seconds / 60:.0f}m ago" if seconds < 7200 \
        else f"{seconds / 3600:.0f}h ago"


def _cmd_status(args: argparse.Namespace) -> int:
    """The cluster as its store sees it: every node, its state and lease, and the sessions it holds."""
    import json

    async def action(gateway) -> int:  # type: ignore[no-untyped-def]
        nodes = await gateway.store.list_nodes()
        held = await gateway.store.open_sessions_by_node()
        if not args.all:
            nodes = [n for n in nodes if n.status == "up" or held.get(n.id)]
        if args.json or args.output == "json":
            print(json.dumps({"nodes": [
                {"id": n.id, "name": n.name, "status": n.status, "slot": n.slot, "host": n.host, "pid": n.pid,
                 "version": n.version, "api_address": n.api_address, "listeners": n.listeners,
                 "started_at": n.started_at, "heartbeat_at": n.heartbeat_at, "stopped_at": n.stopped_at,
                 "stop_reason": n.stop_reason, "open_sessions": held.get(n.id, 0)} for n in nodes],
                "open_sessions": sum(held.values()), "store": describe(gateway.config)}, indent=2))
            return 0
        lease = gateway.config["cluster.lease"]
        print(f"{describe(gateway.config)}; lease {lease:g}s")
        rows = [("NODE", "STATUS", "SLOT", "PID", "VERSION", "API", "STARTED", "HEARTBEAT", "SESSIONS")]
        for n in sorted(nodes, key=lambda n: (n.status != "up", n.name)):
            rows.append((n.name, n.status, str(n.slot), str(n.pid), n.version, n.api_address, _age(n.started_at),
                         _age(n.heartbeat_at) if n.status == "up" else _age(n.stopped_at),
                         str(held.get(n.id, 0))))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        for row in rows:
            print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
        up = sum(1 for n in nodes if n.status == "up")
        print(f"{up} node{'s' if up != 1 else ''} up, {sum(held.values())} open session"
              f"{'s' if sum(held.values()) != 1 else ''}" + (f" ({held[None]} held by no node)" if held.get(None)
                                                             else ""))
        return 0

    config = load(args.config)
    if config["store.driver"] == "sqlite" and not config.store_path.is_file() and not args.config \
            and not os.environ.get("GATEWAYD_CONFIG"):
        return _status_from_api(args, config)
    return asyncio.run(_with_core(config, action))


def _status_from_api(args: argparse.Namespace, config: Config) -> int:
    """``gatewayd status`` away from the gateway's host (no store here): the gateway's readiness, as its API says."""
    from gatewayd.client.api import Api, ClientError, Login
    from gatewayd.client.commands import printable

    login = Login.load(None, getattr(args, "profile", None))
    try:
        ready = Api(login).call("GET", "/readyz", anonymous=True, expect=(200, 503)).data or {}
    except ClientError as exc:
        raise ConfigError(f"no gateway store here ({config.store_path}) to read the cluster from, and "
                          f"{printable(exc, one_line=True)}; "
                          "on the gateway's host, run it with its --config") from None
    if args.json or getattr(args, "output", "") == "json":
        print(json.dumps({"url": login.url, "status": ready.get("status", "")}))
    else:
        print(f"{login.url}: {printable(ready.get('status', 'unknown'), one_line=True)} (as its API says; the nodes "
              "and their sessions are listed on the gateway's host: gatewayd status --config ...)")
    return 0 if ready.get("status") == "ready" else 1


def _print_verification(result) -> int:  # type: ignore[no-untyped-def]
    """Say what was checked and what failed; exit 0 when intact, 1 when altered or not verifiable."""
    state = "intact" if result.verified else "ALTERED OR NOT VERIFIABLE"
    print(f"{result.subject}: {state} ({result.links} links, {result.entries} entries"
          f"{', sealed' if result.sealed else ''}; chain head {result.chain_head})")
    for problem in result.problems:
        print(f"  - {problem}")
    return 0 if result.verified else 1


def _cmd_sessions_verify(args: argparse.Namespace) -> int:
    config = load(args.config)

    async def action(gateway):  # type: ignore[no-untyped-def]
        session = await gateway.store.get_session(args.session_id)
        if session is None:
            raise ConfigError(f"session {args.session_id}: not found in {describe(config)}")
        return await gateway.recording.verify(session)

    return _print_verification(asyncio.run(_with_core(config, action)))


def _cmd_audit_verify(args: argparse.Namespace) -> int:
    config = load(args.config)

    async def action(gateway):  # type: ignore[no-untyped-def]
        org_id = args.org or (await gateway.store.default_org()).id
        return await gateway.audit.verify(org_id)

    return _print_verification(asyncio.run(_with_core(config, action)))


def _cmd_agent(args: argparse.Namespace) -> int:
    """``gatewayd agent``: run an agent until stopped (or its token is refused: exit 3)."""
    from gatewayd import logs
    from gatewayd.agent.channel import ChannelError, Target
    from gatewayd.agent.runner import AgentProcess

    token = args.token or os.environ.get("GATEWAYD_AGENT_TOKEN", "")
    if not token:
        raise ConfigError("--token (or $GATEWAYD_AGENT_TOKEN): the token POST /api/agents answered")
    try:
        Target.parse(args.url)
    except ChannelError as exc:
        raise ConfigError(str(exc)) from None
    logs.configure(args.log_format, args.log_level)
    try:
        workers = args.workers if args.workers is not None else int(os.environ.get("GATEWAYD_AGENT_WORKERS") or 1)
    except ValueError:
        workers = -1
    if workers < 0:
        raise ConfigError("--workers (or $GATEWAYD_AGENT_WORKERS): a number of processes (0: one per core)")
    process = AgentProcess(args.url, token, fingerprint=args.tls_fingerprint or "", ca_file=args.ca_file or "",
                           keepalive=args.keepalive, workers=workers or os.cpu_count() or 1,
                           log_format=args.log_format, log_level=args.log_level)
    return _until_stopped(process.run)


def _cmd_proxy_manager(args: argparse.Namespace) -> int:
    """``gatewayd proxy-manager``: open the local ports the gateway asks for until stopped."""
    from gatewayd import logs
    from gatewayd.agent.channel import ChannelError, Target
    from gatewayd.agent.manager_client import ProxyManagerProcess

    token = args.token or os.environ.get("GATEWAYD_TOKEN", "")
    if not token:
        raise ConfigError("--token (or $GATEWAYD_TOKEN): your bearer token (gatewayd login)")
    try:
        Target.parse(args.url)
    except ChannelError as exc:
        raise ConfigError(str(exc)) from None
    logs.configure(args.log_format, args.log_level)
    process = ProxyManagerProcess(args.url, token, args.tls_fingerprint or "", args.ca_file or "")
    return _until_stopped(process.run)


def _until_stopped(run: Callable[[], Awaitable[int]]) -> int:
    """Run a long-lived client (an agent, a proxy manager) until it ends (its exit code) or SIGTERM/SIGINT (0)."""
    import signal

    async def main() -> int:
        task = asyncio.ensure_future(run())
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        try:
            return await task
        except asyncio.CancelledError:
            return 0

    return run_loop(main())


Command = Callable[[argparse.Namespace], int]


def build_parser(run: Command | None = None) -> argparse.ArgumentParser:
    """The command line; ``run`` (the daemon) is the composition root's to give (launcher.cli)."""
    parser = argparse.ArgumentParser(prog="gatewayd", description="Access gateway for databases and servers.")
    sub = parser.add_subparsers(dest="command", required=True)

    if run is not None:
        run_parser = sub.add_parser("run", help="run the daemon")
        run_parser.add_argument("--config",
                                help="TOML configuration file (default: $GATEWAYD_CONFIG or embedded defaults)")
        run_parser.set_defaults(func=run)

    token = sub.add_parser("token", help="bearer tokens").add_subparsers(dest="token_command", required=True)
    create = token.add_parser("create", help="print a bearer token for a user, creating the user if needed")
    create.add_argument("--email", required=True)
    create.add_argument("--name")
    create.add_argument("--groups", help="comma-separated groups; replaces the user's groups")
    create.add_argument("--ttl", help="lifetime such as 30m or 12h (default: auth.token_ttl)")
    create.add_argument("--operator", action="store_true",
                        help="also make the user an operator: gateway-wide settings (listeners, SSH host key)")
    create.add_argument("--config")
    create.set_defaults(func=_cmd_token_create)

    user = sub.add_parser("user", help="local users").add_subparsers(dest="user_command", required=True)
    passwd = user.add_parser("passwd", help="set a local user's login password, creating the user if needed")
    passwd.add_argument("--email", required=True)
    passwd.add_argument("--name")
    passwd.add_argument("--groups", help="comma-separated groups for a new user")
    passwd.add_argument("--password-stdin", action="store_true", help="read the password from standard input")
    passwd.add_argument("--operator", action="store_true", help="also make the user an operator of the gateway")
    passwd.add_argument("--config")
    passwd.set_defaults(func=_cmd_user_passwd)
    operator = user.add_parser("operator", help="make an existing user an operator of the whole gateway "
                                                "(listeners, SSH host key), or --revoke it")
    who = operator.add_mutually_exclusive_group(required=True)
    who.add_argument("--email")
    who.add_argument("--subject", help="the identity provider's subject, where one e-mail has several users "
                                       "(multi-tenant mode)")
    operator.add_argument("--revoke", action="store_true")
    operator.add_argument("--config")
    operator.set_defaults(func=_cmd_user_operator)

    sessions_parser = sub.add_parser("sessions", help="recorded sessions (a table; show, replay, export, verify)")
    sessions = sessions_parser.add_subparsers(dest="sessions_command")
    verify = sessions.add_parser("verify", help="tell whether a session's recording was altered since it was written "
                                                "(on the gateway's host, from its store)")
    verify.add_argument("session_id")
    verify.add_argument("--config")
    verify.set_defaults(func=_cmd_sessions_verify)

    audit = sub.add_parser("audit", help="the security audit log").add_subparsers(dest="audit_command", required=True)
    verify = audit.add_parser("verify", help="tell whether an organization's audit log was altered")
    verify.add_argument("--org", help="organization id (default: the default organization)")
    verify.add_argument("--config")
    verify.set_defaults(func=_cmd_audit_verify)

    agent = sub.add_parser("agent", help="run an agent inside a private network: it connects out to the gateway "
                                          "and carries the gateway's connections to targets only it reaches")
    agent.add_argument("--url", required=True, help="the gateway's gRPC URL, grpcs://host:port (grpc_server_url)")
    agent.add_argument("--token", help="the agent's token; better $GATEWAYD_AGENT_TOKEN, which other local users "
                                       "cannot read (they can read a process's arguments)")
    agent.add_argument("--tls-fingerprint", help="SHA-256 of the gateway's certificate (hex), for a self-signed one")
    agent.add_argument("--ca-file", help="PEM file of the authority that signed the gateway's certificate")
    agent.add_argument("--keepalive", type=float, default=10.0,
                       help="seconds between pings to the gateway: a cut network is noticed within about twice that")
    agent.add_argument("--workers", type=int, default=None,
                       help="processes that carry the streams' bytes, for an agent whose targets keep one core busy "
                            "(default 1, or $GATEWAYD_AGENT_WORKERS; 0: one per core); with more than one, the "
                            "main process dials and answers and N carrier processes carry the bytes")
    agent.add_argument("--log-format", default="plain", choices=("plain", "json"))
    agent.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    agent.set_defaults(func=_cmd_agent)

    manager = sub.add_parser("proxy-manager", help="on your machine: open the local ports that "
                                                   "POST /api/proxymanager/connect asks for, forwarded through the gateway")
    manager.add_argument("--url", required=True, help="the gateway's gRPC URL, grpcs://host:port (grpc_server_url)")
    manager.add_argument("--token", help="your bearer token; better $GATEWAYD_TOKEN, which other local users cannot "
                                         "read (they can read a process's arguments)")
    manager.add_argument("--tls-fingerprint", help="SHA-256 of the gateway's certificate (hex), for a self-signed one")
    manager.add_argument("--ca-file", help="PEM file of the authority that signed the gateway's certificate")
    manager.add_argument("--log-format", default="plain", choices=("plain", "json"))
    manager.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    manager.set_defaults(func=_cmd_proxy_manager)

    from gatewayd.client import commands as people

    people.register(sub, sessions_parser, sessions)
    from gatewayd.client import runbooks as runbook_commands

    runbook_commands.register(sub)

    status = people.command(sub, "status", "the cluster: every gateway node (and worker) sharing the store, its "
                                           "lease and its open sessions (on the gateway's host; elsewhere, the "
                                           "readiness of the gateway you logged in to)",
                            "gatewayd status --config /etc/gatewayd/gatewayd.toml\ngatewayd status --all --output json")
    status.add_argument("--all", action="store_true", help="also nodes that stopped or were lost")
    status.add_argument("--output", choices=("table", "json"), default="table")
    status.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    status.add_argument("--profile", help="elsewhere than the gateway's host: which saved login's gateway")
    status.add_argument("--config")
    status.set_defaults(func=_cmd_status)

    version = people.command(sub, "version", "print the version", "gatewayd version --output json")
    version.add_argument("--output", choices=("text", "json"), default="text")
    version.set_defaults(func=lambda args: print(json.dumps({"version": __version__}) if args.output == "json"
                                                 else __version__) or 0)
    people.register_completion(sub, parser)
    return parser


def main(argv: list[str] | None = None, run: Command | None = None) -> int:
    from gatewayd.client.commands import split_client_args

    argv, client_args = split_client_args(list(sys.argv[1:] if argv is None else argv))
    args = build_parser(run).parse_args(argv)
    if client_args:
        args.client_args = client_args
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"gatewayd: configuration error: {exc}", file=sys.stderr)
        return 2
    except StoreError as exc:  # the store cannot be opened (its message holds no password)
        print(f"gatewayd: store error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a bug: one line, and the traceback only when asked for
        if os.environ.get("GATEWAYD_DEBUG"):
            raise
        print(f"gatewayd: unexpected error ({type(exc).__name__}: {exc}); GATEWAYD_DEBUG=1 shows where",
              file=sys.stderr)
        return 1

