"""The offline analyzer: built-in rules that rate SQL statements and shell commands, no provider needed.

SQL is read as PostgreSQL's own parse tree (``pglast``, libpg_query), walked
whole so that a ``DELETE`` inside a ``WITH`` or a ``COPY ... TO PROGRAM`` deep
in a script is seen; text that does not parse falls back to a keyword scan of
the comment-free text.  Shell text is split into simple commands (``;``,
``&&``, ``||``, ``|``, ``&``, new lines), each read as its argument vector.
Every finding has a level; a text's rating is its riskiest finding.
"""

from __future__ import annotations

import os
import re
import shlex
from typing import Any, Iterator

from gatewayd import protocols
from gatewayd.analysis.verdict import HIGH, LOW, MEDIUM, Rating, severity
from gatewayd.languages import SHELL, SHELL_COMMANDS, SQL, Language
from gatewayd.sql.pg_scan import normalize_sql

NOTHING_FOUND = Rating(LOW, "No risky operation", "The built-in rules found no destructive, privileged or "
                                                  "server-level operation in it.")


def language_of(subtype: str) -> Language:
    """How a connection's input is read: its protocol's language (gatewayd.languages), never a guess."""
    return protocols.language_of(subtype)


def rate(text: str, language: Language) -> Rating:
    """The riskiest finding of the built-in rules in ``text``, read in ``language``: PostgreSQL's SQL by its own
    rules, another SQL dialect by the statement kinds its parser finds, shell commands by the shell rules; a
    language with no built-in rules (HTTP, key strokes) is not rated (LOW, saying so)."""
    if language.family == SQL and language.dialect is not None:
        findings = (sql_findings(text) if language.dialect.name == "postgresql"
                    else kind_findings(text, language))
    elif language.family == SHELL:
        findings = shell_findings(text)
    else:
        return Rating(LOW, "Not rated", f"The built-in rules read SQL and shell commands, not {language.title}.",
                      "offline")
    best: Rating | None = None
    for finding in findings:
        if best is None or severity(finding.risk_level) > severity(best.risk_level):
            best = finding
            if finding.risk_level == HIGH:
                break
    return best or NOTHING_FOUND


# --------------------------------------------------------------------------- SQL

_KIND_RISKS = (  # a SQL dialect other than PostgreSQL: the statement kinds its parser finds (the shared vocabulary)
    ({"DropStmt", "DropdbStmt", "DropOwnedStmt", "DropRoleStmt", "DropTableSpaceStmt", "TruncateStmt"}, HIGH,
     "Drops or empties data", "The statement drops objects or removes every row of a table."),
    ({"AlterRoleStmt", "CreateRoleStmt", "GrantStmt", "GrantRoleStmt", "RevokeStmt", "AlterSystemStmt"}, HIGH,
     "Changes privileges or the server", "The statement changes roles, privileges or server settings."),
    ({"AlterTableStmt", "RenameStmt", "AlterDatabaseStmt", "CreateFunctionStmt", "DoStmt"}, MEDIUM,
     "Changes the schema or runs code", "The statement changes the schema or defines code that runs later."),
)


def kind_findings(text: str, language: Language) -> list[Rating]:
    """What a SQL dialect's parse says of ``text`` (every dialect maps its statements onto the shared kinds)."""
    assert language.dialect is not None
    parsed = language.dialect.parse(text)
    if parsed is None:
        return [_finding(MEDIUM, "Unparsable SQL", f"The text does not parse as {language.title}; it was not read.")]
    findings = []
    for statement in parsed:
        if statement.unreadable:
            findings.append(_finding(MEDIUM, "Partly unreadable", f"It holds {statement.unreadable}."))
        for kinds, level, title, explanation in _KIND_RISKS:
            if not statement.counts_as.isdisjoint(kinds):
                findings.append(_finding(level, title, explanation))
        if statement.unqualified:
            findings.append(_finding(HIGH, "Changes every row", "A DELETE or UPDATE without WHERE (or with its "
                                                               "effect) touches every row of a table."))
    return findings

_HIGH_DROPS = {"OBJECT_TABLE", "OBJECT_SCHEMA", "OBJECT_DATABASE", "OBJECT_MATVIEW", "OBJECT_SEQUENCE",
               "OBJECT_TYPE", "OBJECT_EXTENSION", "OBJECT_FOREIGN_TABLE", "OBJECT_TABLESPACE"}
_FILE_FUNCTIONS = {"pg_read_file", "pg_read_binary_file", "pg_ls_dir", "pg_stat_file", "lo_import", "lo_export",
                   "pg_file_write", "pg_file_unlink", "pg_file_rename"}
_ADMIN_FUNCTIONS = {"pg_terminate_backend", "pg_cancel_backend", "pg_reload_conf", "pg_rotate_logfile",
                    "pg_promote", "pg_switch_wal", "set_config"}
_REMOTE_FUNCTIONS = {"dblink", "dblink_exec", "dblink_connect"}
_PRIVILEGED_ROLES = {"pg_execute_server_program", "pg_read_server_files", "pg_write_server_files",
                     "pg_signal_backend", "pg_monitor", "pg_read_all_data", "pg_write_all_data"}
_ROLE_POWERS = {"superuser", "bypassrls", "replication", "createrole"}


def _finding(level: str, title: str, explanation: str) -> Rating:
    return Rating(level, title, explanation, "offline")


def _walk(node: Any) -> Iterator[Any]:
    """Every node of a pglast tree, depth first; a plain EXPLAIN's statement is skipped (it does not run)."""
    from pglast import ast

    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
            continue
        if not isinstance(item, ast.Node):
            continue
        yield item
        if isinstance(item, ast.ExplainStmt) and not any(
                getattr(o, "defname", "") == "analyze" for o in item.options or ()):
            continue
        for name in item.__slots__:  # type: ignore[attr-defined]
            value = getattr(item, name, None)
            if isinstance(value, (ast.Node, list, tuple)):
                stack.append(value)


def _relation(relation: Any) -> str:
    if relation is None:
        return "a table"
    schema = getattr(relation, "schemaname", None)
    return f"{schema}.{relation.relname}" if schema else str(relation.relname)


def _names(items: Any) -> list[str]:
    return [getattr(i, "sval", "") for i in items or ()]


def _true_options(options: Any) -> set[str]:
    found = set()
    for option in options or ():
        arg = getattr(option, "arg", None)
        value = getattr(arg, "boolval", getattr(arg, "ival", True))
        if value:
            found.add(getattr(option, "defname", ""))
    return found


def _node_finding(node: Any) -> Rating | None:
    from pglast import ast, enums

    if isinstance(node, ast.DropStmt):
        kind = enums.ObjectType(node.removeType).name  # type: ignore[arg-type]
        what = kind.removeprefix("OBJECT_").lower().replace("_", " ")
        level = HIGH if kind in _HIGH_DROPS else MEDIUM
        article = "an" if what[:1] in ("a", "e", "i", "o", "u") else "a"
        return _finding(level, f"Drops {article} {what}", f"DROP {what.upper()} removes the object and everything "
                                                          "in it; it cannot be undone without a backup.")
    if isinstance(node, ast.DropdbStmt):
        return _finding(HIGH, "Drops a database", f"DROP DATABASE {node.dbname} removes the whole database.")
    if isinstance(node, ast.DropRoleStmt):
        return _finding(HIGH, "Drops a role", "DROP ROLE removes database accounts and their access.")
    if isinstance(node, ast.DropTableSpaceStmt):
        return _finding(HIGH, "Drops a tablespace", "DROP TABLESPACE removes a storage location of the server.")
    if isinstance(node, ast.TruncateStmt):
        tables = ", ".join(_relation(r) for r in node.relations or ())
        return _finding(HIGH, "Truncates a table", f"TRUNCATE empties {tables} at once; the rows cannot be "
                                                   "recovered without a backup.")
    if isinstance(node, ast.DeleteStmt):
        table = _relation(node.relation)
        if node.whereClause is None:
            return _finding(HIGH, "Delete without WHERE", f"DELETE without a WHERE clause removes every row of "
                                                          f"{table}.")
        return _finding(MEDIUM, "Deletes rows", f"DELETE removes the rows of {table} that match its WHERE clause.")
    if isinstance(node, ast.UpdateStmt):
        table = _relation(node.relation)
        if node.whereClause is None and not node.fromClause:
            return _finding(HIGH, "Update without WHERE", f"UPDATE without a WHERE clause rewrites every row of "
                                                          f"{table}.")
        return _finding(MEDIUM, "Updates rows", f"UPDATE changes the rows of {table} that match its WHERE clause.")
    if isinstance(node, ast.AlterSystemStmt):
        return _finding(HIGH, "Alters server configuration", "ALTER SYSTEM changes the configuration of the whole "
                                                             "PostgreSQL server.")
    if isinstance(node, ast.CopyStmt):
        if node.is_program:
            return _finding(HIGH, "COPY runs a program", "COPY ... PROGRAM runs a shell command on the database "
                                                         "server as its operating-system user.")
        if node.filename:
            return _finding(HIGH, "COPY server file", "COPY with a file name reads or writes a file on the "
                                                      "database server's file system.")
        return None
    if isinstance(node, ast.GrantStmt):
        verb = "GRANT" if node.is_grant else "REVOKE"
        public = any(getattr(g, "roletype", None) == enums.RoleSpecType.ROLESPEC_PUBLIC
                     for g in node.grantees or ())
        if node.is_grant and public:
            return _finding(HIGH, "Grants to PUBLIC", "GRANT to PUBLIC gives every role of the server the "
                                                      "privileges.")
        return _finding(MEDIUM, "Changes privileges", f"{verb} changes who may read or change database objects.")
    if isinstance(node, ast.GrantRoleStmt):
        roles = {getattr(r, "priv_name", "") for r in node.granted_roles or ()}
        if node.is_grant and roles & _PRIVILEGED_ROLES:
            return _finding(HIGH, "Grants server privileges", f"GRANT {', '.join(sorted(roles & _PRIVILEGED_ROLES))}"
                                                              " lets a role reach the server's files or programs.")
        return _finding(MEDIUM, "Changes role membership", "GRANT or REVOKE of a role changes who holds its "
                                                           "privileges.")
    if isinstance(node, (ast.CreateRoleStmt, ast.AlterRoleStmt)):
        powers = _true_options(node.options) & _ROLE_POWERS
        if powers:
            return _finding(HIGH, "Grants role superpowers", f"The role gets {', '.join(sorted(powers))}: it can "
                                                             "bypass the database's access controls.")
        verb = "Creates" if isinstance(node, ast.CreateRoleStmt) else "Alters"
        return _finding(MEDIUM, f"{verb} a role", "Database accounts and their rights change.")
    if isinstance(node, ast.AlterTableStmt):
        dropping = any(getattr(c, "subtype", None) == enums.AlterTableType.AT_DropColumn for c in node.cmds or ())
        if dropping:
            return _finding(HIGH, "Drops a column", f"ALTER TABLE {_relation(node.relation)} DROP COLUMN removes "
                                                    "the column and its data.")
        return _finding(MEDIUM, "Alters a table", f"ALTER TABLE changes the structure of "
                                                  f"{_relation(node.relation)}.")
    if isinstance(node, ast.DoStmt):
        return _finding(MEDIUM, "Runs procedural code", "A DO block runs procedural code the rules cannot see "
                                                        "into.")
    if isinstance(node, ast.FuncCall):
        name = (_names(node.funcname) or [""])[-1].lower()
        if name in _FILE_FUNCTIONS:
            return _finding(HIGH, "Reads server files", f"{name}() reaches the database server's file system.")
        if name in _REMOTE_FUNCTIONS:
            return _finding(HIGH, "Connects elsewhere", f"{name}() opens a connection from the database server "
                                                        "to another database.")
        if name in _ADMIN_FUNCTIONS:
            return _finding(MEDIUM, "Server administration", f"{name}() acts on the server or on other sessions.")
    return None


def sql_findings(text: str) -> list[Rating]:
    """What the built-in rules see in ``text``: the parse tree, or a keyword scan when it does not parse."""
    try:
        from pglast import parse_sql
        from pglast.parser import ParseError

        statements = parse_sql(text)
    except ImportError:  # pragma: no cover - pglast is a dependency; never fail open on its absence
        return _sql_keyword_findings(text)
    except ParseError:
        return _sql_keyword_findings(text) or [_finding(LOW, "Unparsed SQL", "The statement does not parse as "
                                                              "PostgreSQL SQL and holds no risky keyword.")]
    findings = []
    for node in _walk(list(statements)):
        finding = _node_finding(node)
        if finding is not None:
            findings.append(finding)
    return findings


_SQL_KEYWORDS: tuple[tuple[re.Pattern[str], str, str, str], ...] = tuple(
    (re.compile(pattern, re.I), level, title, explanation) for pattern, level, title, explanation in (
        (r"\bdrop\s+(table|schema|database|materialized|sequence|type|extension|role|user|tablespace)\b", HIGH,
         "Drops an object", "The text drops a database object; it cannot be undone without a backup."),
        (r"\btruncate\b", HIGH, "Truncates a table", "TRUNCATE empties tables at once."),
        (r"\bdelete\s+from\s+[\w.\"]+\s*(;|$)", HIGH, "Delete without WHERE",
         "DELETE without a WHERE clause removes every row."),
        (r"\bupdate\s+[\w.\"]+\s+set\b(?![^;]*\bwhere\b)", HIGH, "Update without WHERE",
         "UPDATE without a WHERE clause rewrites every row."),
        (r"\balter\s+system\b", HIGH, "Alters server configuration", "ALTER SYSTEM changes the server's "
                                                                      "configuration."),
        (r"\bcopy\b[^;]*\b(to|from)\s+program\b", HIGH, "COPY runs a program",
         "COPY ... PROGRAM runs a shell command on the database server."),
        (r"\b(grant|revoke)\b", MEDIUM, "Changes privileges", "GRANT or REVOKE changes who may use objects."),
        (r"\b(delete|update|alter|drop)\b", MEDIUM, "Changes data or schema",
         "The text changes data or the schema; it did not parse, so the rules read keywords only."),
    ))


def _sql_keyword_findings(text: str) -> list[Rating]:
    """The fallback for text pglast cannot parse: keywords of the comment-free text."""
    flat = normalize_sql(text)
    return [_finding(level, title, explanation) for pattern, level, title, explanation in _SQL_KEYWORDS
            if pattern.search(flat)]


# --------------------------------------------------------------------------- shell

_SEPARATORS = re.compile(r"\|\||&&|[;\n&]")
_PIPE = re.compile(r"(?<!\|)\|(?!\|)")
_WRAPPERS = {"sudo", "doas", "nohup", "time", "exec", "command", "builtin", "nice", "ionice", "env", "xargs",
             "stdbuf", "timeout"}
_SHELLS = {"sh", "bash", "zsh", "ksh", "dash", "fish", "python", "python3", "perl", "ruby", "node", "php"}
_DOWNLOADERS = {"curl", "wget", "fetch"}
_DISK_TOOLS = {"mkfs", "mke2fs", "mkswap", "wipefs", "fdisk", "sfdisk", "parted", "shred", "blkdiscard"}
_POWER = {"shutdown", "reboot", "halt", "poweroff"}
_ACCOUNT_TOOLS = {"userdel", "groupdel", "usermod", "passwd", "chpasswd", "visudo", "deluser"}
_KILLERS = {"killall", "pkill"}
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_RAW_PATTERNS: tuple[tuple[re.Pattern[str], str, str, str], ...] = tuple(
    (re.compile(pattern), level, title, explanation) for pattern, level, title, explanation in (
        (r":\(\)\s*\{\s*:\s*\|\s*:\s*&\s*\}\s*;\s*:", HIGH, "Fork bomb", "The function forks itself until the "
                                                                        "host runs out of processes."),
        (r"(<\(|\$\(|`)\s*(curl|wget)\b", HIGH, "Runs downloaded code", "Code downloaded from the network is "
                                                                         "run unseen by a shell."),
        (r">\s*/dev/(sd[a-z]|nvme\d|vd[a-z]|xvd[a-z]|hd[a-z]|mmcblk\d)", HIGH, "Overwrites a disk",
         "Output redirected onto a block device destroys its file systems."),
        (r"/dev/(tcp|udp)/", HIGH, "Opens a network shell", "Redirection to /dev/tcp is the classic reverse "
                                                             "shell: it hands the host to a remote party."),
        (r"\bunset\s+HISTFILE\b|\bHISTFILE=/dev/null\b|\bhistory\s+-c\b", MEDIUM, "Hides shell history",
         "The command erases or stops the shell history, hiding what is run."),
    ))


def _argv(segment: str) -> list[str]:
    try:
        words = shlex.split(segment, comments=True)
    except ValueError:  # an unbalanced quote: read it word by word
        words = segment.split()
    while words and (_ASSIGNMENT.match(words[0]) or os.path.basename(words[0]) in _WRAPPERS or
                     (words[0].startswith("-") and len(words) > 1)):
        words = words[1:]
    return words


def _short_flags(args: list[str]) -> set[str]:
    flags: set[str] = set()
    for arg in args:
        if arg.startswith("--"):
            flags.add(arg)
        elif arg.startswith("-") and len(arg) > 1:
            flags.update(arg[1:])
    return flags


def _command_finding(argv: list[str]) -> Rating | None:
    if not argv:
        return None
    name = os.path.basename(argv[0])
    args = argv[1:]
    flags = _short_flags(args)
    targets = [a for a in args if not a.startswith("-")]
    if name in _SHELLS and "-c" in args[:-1]:  # sh -c 'text': the text is what runs
        return rate(args[args.index("-c") + 1], SHELL_COMMANDS) if args[args.index("-c") + 1].strip() else None
    if name == "rm":
        recursive = bool(flags & {"r", "R", "--recursive"})
        force = bool(flags & {"f", "--force"})
        rooted = any(t in ("/", "/*", "~", "~/", "*", ".") or t.rstrip("/") in ("", "/*") for t in targets)
        if "--no-preserve-root" in flags or (recursive and (force or rooted)):
            return _finding(HIGH, "Recursive forced delete", f"rm {' '.join(args)} deletes whole directory trees "
                                                             "without asking; nothing can be restored.")
        return _finding(MEDIUM, "Deletes files", "rm removes files for good.")
    if name in _DISK_TOOLS or name.startswith("mkfs."):
        return _finding(HIGH, "Formats a disk", f"{name} destroys the data on a disk or partition.")
    if name == "dd" and any(a.startswith("of=/dev/") for a in args):
        return _finding(HIGH, "Writes a raw device", "dd onto a device overwrites the disk below its file "
                                                     "systems.")
    if name in _POWER or (name in ("init", "telinit") and targets[:1] in (["0"], ["6"])) or \
            (name == "systemctl" and targets[:1] in (["poweroff"], ["reboot"], ["halt"], ["kexec"])):
        return _finding(HIGH, "Shuts the host down", f"{' '.join(argv[:2])} stops or restarts the whole host and "
                                                     "every service on it.")
    if name in ("chmod", "chown", "chgrp") and flags & {"R", "--recursive"} and "/" in targets:
        return _finding(HIGH, "Rewrites root permissions", f"{name} -R / changes the owner or mode of every file "
                                                           "of the host.")
    if name == "chmod" and any(t in ("777", "a+rwx", "o+w") for t in targets):
        return _finding(MEDIUM, "World-writable files", "chmod makes files writable by every user of the host.")
    if name in ("nc", "ncat", "netcat") and flags & {"e", "c"}:
        return _finding(HIGH, "Opens a network shell", f"{name} -e hands a shell to whoever connects.")
    if name == "socat" and any(t.lower().startswith(("exec:", "system:")) for t in targets):
        return _finding(HIGH, "Opens a network shell", "socat with EXEC or SYSTEM hands a program to the network.")
    if name == "kill" and "-1" in args:
        return _finding(HIGH, "Kills every process", "kill -1 signals every process the user may signal.")
    if name in _KILLERS:
        return _finding(MEDIUM, "Kills processes", f"{name} ends processes by name.")
    if name in _ACCOUNT_TOOLS:
        return _finding(MEDIUM, "Changes accounts", f"{name} changes the host's user accounts or their rights.")
    if name == "crontab" and "r" in flags:
        return _finding(MEDIUM, "Removes scheduled jobs", "crontab -r deletes every scheduled job of the user.")
    if name in ("iptables", "ip6tables") and flags & {"F", "--flush"} or \
            name == "nft" and targets[:2] == ["flush", "ruleset"] or name == "ufw" and targets[:1] == ["disable"]:
        return _finding(HIGH, "Drops firewall rules", "The host's firewall rules are removed: every port is open.")
    if name == "systemctl" and targets[:1] in (["stop"], ["disable"], ["mask"], ["kill"]):
        return _finding(MEDIUM, "Stops a service", f"systemctl {targets[0]} takes a service of the host down.")
    if name == "find" and "-delete" in args:
        return _finding(MEDIUM, "Deletes found files", "find -delete removes every file the expression matches.")
    if name == "kubectl" and targets[:1] == ["delete"]:
        return _finding(MEDIUM, "Deletes cluster resources", "kubectl delete removes resources from a cluster.")
    return None


def shell_findings(text: str) -> list[Rating]:
    """What the built-in rules see in shell ``text``: whole-text patterns, then each simple command."""
    findings = [_finding(level, title, explanation) for pattern, level, title, explanation in _RAW_PATTERNS
                if pattern.search(text)]
    for line in _SEPARATORS.split(text):
        stages = [_argv(stage) for stage in _PIPE.split(line)]
        for index, argv in enumerate(stages):
            finding = _command_finding(argv)
            if finding is not None:
                findings.append(finding)
            if argv and os.path.basename(argv[0]) in _DOWNLOADERS and any(
                    later and os.path.basename(later[0]) in _SHELLS for later in stages[index + 1:]):
                findings.append(_finding(HIGH, "Pipes download to shell", f"{argv[0]} output piped into a shell "
                                                                          "runs unreviewed code from the "
                                                                          "network."))
    return findings

