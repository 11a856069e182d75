"""The people's commands for runbooks and reports (list the runbooks, see one's form, run it; session reports),
and an admin's for the organization's API key and the webhooks' delivery log.

``gatewayd runbooks run NAME --connection C -p key=value`` runs a runbook as ``gatewayd exec`` runs a script:
it waits for the review when the connection asks for one, then prints the output and exits with the script's
exit code. A secret parameter is asked for at the terminal (``--secret NAME``), never put on the command line.
"""

from __future__ import annotations

import argparse
import getpass
import sys
from typing import Any

from gatewayd.client.api import EXIT_FAILED, EXIT_USAGE, Api, ClientError, Login
from gatewayd.client.commands import _wait_review, common, emit, follow_output, people, short


def _runbooks(api: Api, connection: str | None, refresh: bool) -> dict[str, Any]:
    query: dict[str, Any] = {"list_connections": "true"}
    if connection:
        query["connection_name"] = connection
    if refresh:
        query["refresh"] = "true"
    return api.get("/runbooks", **query)


def _find(listing: dict[str, Any], name: str, repository: str | None) -> tuple[str, dict[str, Any]]:
    found = [(repo["repository"], item) for repo in listing["repositories"] for item in repo["items"]
             if item["name"] == name and (repository is None or repo["repository"] == repository)]
    if not found:
        raise ClientError(f"no runbook {name!r} you may run" + (f" in {repository}" if repository else ""))
    if len(found) > 1:
        raise ClientError(f"runbook {name!r} is in several repositories ({', '.join(r for r, _ in found)}): "
                          "say which with --repository", EXIT_USAGE)
    return found[0]


def cmd_runbooks(args: argparse.Namespace) -> int:
    api = Api(Login.load(args.url))
    listing = _runbooks(api, args.connection, args.refresh)
    rows = [{"repository": repo["repository"], "commit": repo["commit"][:10], "name": item["name"],
             "parameters": ", ".join(f"{k}{'*' if v.get('required') else ''}" for k, v in item["metadata"].items()),
             "connections": ", ".join(item.get("connections") or []), "error": item.get("error") or ""}
            for repo in listing["repositories"] for item in repo["items"]]
    for error in listing.get("errors") or []:
        print(f"gatewayd: {error}", file=sys.stderr)
    return emit(args, listing, rows, [("name", "runbook"), ("parameters", "parameters (* required)"),
                                      ("connections", "connections"), ("repository", "repository"),
                                      ("commit", "commit"), ("error", "error")])


def cmd_runbook_show(args: argparse.Namespace) -> int:
    api = Api(Login.load(args.url))
    repository, item = _find(_runbooks(api, None, False), args.name, args.repository)
    if args.json:
        import json

        print(json.dumps({"repository": repository, **item}, indent=2))
        return 0
    print(f"{item['name']} ({repository}), runs on: {', '.join(item.get('connections') or []) or 'no connection'}")
    if item.get("error"):
        print(f"cannot be run: {item['error']}")
    fields = sorted(item["metadata"].items(), key=lambda kv: (kv[1].get("order") is None, kv[1].get("order") or 0))
    for name, spec in fields:
        extras = [spec.get("type", "text")] + (["required"] if spec.get("required") else [])
        if spec.get("options"):
            extras.append("one of " + "|".join(spec["options"]))
        if spec.get("default") is not None:
            extras.append(f"default {spec['default']}")
        print(f"  {name} ({', '.join(extras)}){': ' + spec['description'] if spec.get('description') else ''}")
    return 0


def _parameters(args: argparse.Namespace) -> dict[str, str]:
    values: dict[str, str] = {}
    for pair in args.parameter or []:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise ClientError(f"-p {pair!r}: expected NAME=VALUE", EXIT_USAGE)
        values[name] = value
    for name in args.secret or []:
        values[name] = getpass.getpass(f"{name}: ")
    return values


def cmd_runbook_run(args: argparse.Namespace) -> int:
    api = Api(Login.load(args.url))
    repository = args.repository
    if repository is None:
        repository, _ = _find(_runbooks(api, args.connection, False), args.name, None)
    body: dict[str, Any] = {"connection_name": args.connection, "repository": repository, "file_name": args.name,
                            "parameters": _parameters(args)}
    if args.ref:
        body["ref_hash"] = args.ref
    answer = api.call("POST", "/runbooks/exec", body, expect=(200, 202))
    result = answer.data
    if answer.status == 202 and result.get("has_review") and not result.get("output_status"):
        again = f"run it once approved with `gatewayd exec --review {short(result['review_id'])}`"
        review = _wait_review(api, result["review_id"], "runbook", again)
        if review["status"] != "APPROVED":
            raise ClientError(f"the runbook was not run: its review is {review['status']}")
        result = api.call("POST", f"/sessions/{result['session_id']}/exec", expect=(200, 201, 202),
                          headers={"Prefer": "respond-async"}).data
    if result.get("output_status") == "running":
        return follow_output(api, result["session_id"])
    sys.stdout.write(result.get("output") or "")
    code = result.get("exit_code")
    return int(code) if code is not None else EXIT_FAILED


def cmd_reports(args: argparse.Namespace) -> int:
    api = Api(Login.load(args.url))
    report = api.get("/reports/sessions", group_by=args.group_by, start_date=args.start, end_date=args.end,
                     connection_name=args.connection, user_email=args.user)
    rows = [{**item, "duration": f"{item['duration_seconds']} s"} for item in report["items"]]
    if not args.json:
        print(f"sessions from {report['start_date']} to {report['end_date']}, by {report['group_by']}",
              file=sys.stderr)
    return emit(args, report, rows, [("resource", args.group_by), ("sessions", "sessions"),
                                     ("duration", "duration"), ("bytes", "bytes"), ("blocks", "blocks"),
                                     ("masked", "masked values")])


def cmd_org_key(args: argparse.Namespace) -> int:
    api = Api(Login.load(args.url))
    if args.action == "create":
        made = api.call("POST", "/orgs/keys", expect=(201,)).data
        print(made["key"])
        print("the organization's API key: shown this once (send it as the Api-Key header)", file=sys.stderr)
        return 0
    if args.action == "revoke":
        api.call("DELETE", "/orgs/keys", expect=(204,))
        print("the organization's API key is revoked", file=sys.stderr)
        return 0
    key = api.get("/orgs/keys")
    return emit(args, key, [key], [("key_prefix", "key"), ("created_at", "made"), ("created_by", "by"),
                                   ("last_used_at", "last used"), ("service_account", "acts as")])


def cmd_webhooks_log(args: argparse.Namespace) -> int:
    api = Api(Login.load(args.url))
    page = api.get("/webhooks/messages", status=args.status, limit=args.limit)
    return emit(args, page, page["data"], [("created_at", "when"), ("event_type", "event"), ("channel", "to"),
                                           ("status", "status"), ("attempts", "attempts"),
                                           ("last_error", "last error")])


def register(sub: Any) -> None:
    """Add ``runbooks`` (list, show, run) and ``reports`` to the ``gatewayd`` parser."""
    runbooks = sub.add_parser("runbooks", help="the runbooks you may run (show one's form, run one)")
    common(runbooks)
    runbooks.add_argument("--connection", help="only those this connection may run")
    runbooks.add_argument("--refresh", action="store_true", help="fetch the repositories now")
    runbooks.set_defaults(func=people(cmd_runbooks))
    actions = runbooks.add_subparsers(dest="runbook_command")
    show = actions.add_parser("show", help="a runbook's parameters and connections")
    common(show)
    show.add_argument("name", help="its path in the repository (ops/fetch.runbook.sql)")
    show.add_argument("--repository")
    show.set_defaults(func=people(cmd_runbook_show))
    run = actions.add_parser("run", help="run a runbook on a connection (waits for its review); exits with the "
                                         "script's exit code")
    common(run, formats=False)
    run.add_argument("name", help="its path in the repository")
    run.add_argument("--connection", required=True)
    run.add_argument("--repository", help="when several repositories have it")
    run.add_argument("-p", "--parameter", action="append", metavar="NAME=VALUE")
    run.add_argument("--secret", action="append", metavar="NAME", help="ask for this parameter's value at the "
                                                                      "terminal (a password: never on the command "
                                                                      "line)")
    run.add_argument("--ref", help="the commit to run it as (default: the branch's latest)")
    run.set_defaults(func=people(cmd_runbook_run))

    reports = sub.add_parser("reports", help="sessions counted by connection, user, protocol or day "
                                             "(admins and auditors)")
    common(reports)
    reports.add_argument("--group-by", default="connection", choices=("connection", "user", "protocol", "day"))
    reports.add_argument("--from", dest="start", help="first day (YYYY-MM-DD; default a week ago)")
    reports.add_argument("--to", dest="end", help="last day (YYYY-MM-DD; default today)")
    reports.add_argument("--connection")
    reports.add_argument("--user", help="an e-mail")
    reports.set_defaults(func=people(cmd_reports))

    key = sub.add_parser("org-key", help="the organization's API key (admins): show, create (shown once), revoke")
    common(key)
    key.add_argument("action", nargs="?", default="show", choices=("show", "create", "revoke"))
    key.set_defaults(func=people(cmd_org_key))

    hooks = sub.add_parser("webhooks", help="the webhooks' delivery log (admins)")
    common(hooks)
    hooks.add_argument("--status", choices=("pending", "delivered", "failed"))
    hooks.add_argument("--limit", type=int, default=20)
    hooks.set_defaults(func=people(cmd_webhooks_log))

