"""Runbooks: templates kept in a git repository, fetched with the git command and cached per commit.

Each organization names its repositories (``RunbookRepository``: a URL or, for the gateway's own
organization, a local path; a branch; a folder). The gateway keeps a bare clone of each under
``<data_dir>/runbooks`` and fetches it with the ``git`` command in a worker thread (never on the event
loop), when it is first needed, when its last fetch is older than ``runbooks.refresh_interval`` and when
someone asks (``refresh``). What a commit holds is read once and kept (``Catalog``, per commit): a
runbook named with a ``ref_hash`` runs exactly as that commit wrote it.

Credentials are given to git only for the one command, through its environment (``GIT_ASKPASS``, an SSH key
file readable by the gateway alone, removed afterwards); they never appear in a command line, a URL kept
in the clone or a log line. A URL with credentials in it is refused (they belong in the sealed fields).
Tenants (multi-tenant mode) may only name ``https``/``ssh`` URLs whose host resolves to addresses their
policy allows, and git is pinned to the address checked.

``may_run`` says whether runbook rules let a user run a runbook on a connection.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import re
import socket
import subprocess
import tempfile
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable
from urllib.parse import urlsplit

from gatewayd.dialer import AddressPolicy
from gatewayd.models import ADMIN_GROUP, RunbookRepository, RunbookRule, User
from gatewayd.runbook_templates import Template, TemplateError, parse

log = logging.getLogger("gatewayd.runbooks")

RUNBOOK_MARK = ".runbook."  # a file is a runbook when its name carries this (``fetch-customer.runbook.sql``)
MAX_FILE_BYTES = 1 << 20
MAX_FILES = 2000
CATALOGS_KEPT = 64
SECRET_FIELDS = ("git_password", "ssh_key", "ssh_keypass")
_BRANCH = re.compile(r"^(?!-)(?!.*\.\.)(?!.*//)[A-Za-z0-9._/-]{1,200}(?<![./])$")
_SHA = re.compile(r"^[0-9a-f]{7,64}$")
_SCP_LIKE = re.compile(r"^(?:(?P<user>[A-Za-z0-9._-]+)@)?(?P<host>[A-Za-z0-9.-]+):(?P<path>[A-Za-z0-9._~/-]+)$")
_ASKPASS = """#!/bin/sh
# gatewayd's answer to git and ssh prompts: the values come from the environment of the one command
case "$1" in
  Username*) printf '%s\\n' "$GATEWAYD_GIT_USERNAME" ;;
  *) printf '%s\\n' "$GATEWAYD_GIT_SECRET" ;;
esac
"""


class RunbookError(Exception):
    """A repository that cannot be used as configured, or a runbook that is not there; ``status`` for the API."""

    def __init__(self, message: str, status: int = 422) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


@dataclass(slots=True)
class Location:
    """A repository URL taken apart: its scheme (https, http, ssh, local), host, port and normalized name."""

    scheme: str
    host: str
    port: int
    name: str


def locate(git_url: str, *, local_allowed: bool) -> Location:
    """Check ``git_url`` and say where it points (RunbookError when it is not a repository address gatewayd uses)."""
    url = git_url.strip()
    if not url:
        raise RunbookError("git_url: must not be empty")
    if "::" in url or any(c.isspace() or ord(c) < 32 for c in url):
        raise RunbookError("git_url: expected an https, http or ssh URL (or user@host:path)")
    if url.startswith("/"):
        if not local_allowed:
            raise RunbookError("git_url: a local path is for the gateway's own organization only")
        path = os.path.normpath(url)
        return Location("local", "", 0, "local" + path.removesuffix(".git"))
    scp = _SCP_LIKE.match(url) if "://" not in url else None
    if scp is not None:
        return Location("ssh", scp.group("host"), 22,
                        f"{scp.group('host')}/{scp.group('path').strip('/').removesuffix('.git')}")
    parts = urlsplit(url)
    if parts.scheme not in ("https", "http", "ssh"):
        raise RunbookError("git_url: expected an https, http or ssh URL (or user@host:path)"
                           + (", or a local path" if local_allowed else ""))
    if parts.password is not None or (parts.username and parts.scheme != "ssh"):
        raise RunbookError("git_url: credentials do not go in the URL: use git_user and git_password")
    if not parts.hostname or parts.query or parts.fragment:
        raise RunbookError("git_url: expected a repository URL such as https://host/owner/repo")
    try:
        port = parts.port or {"https": 443, "http": 80, "ssh": 22}[parts.scheme]
    except ValueError:
        raise RunbookError("git_url: bad port") from None
    path = parts.path.strip("/").removesuffix(".git")
    if not path:
        raise RunbookError("git_url: expected a repository path after the host")
    return Location(parts.scheme, parts.hostname, port, f"{parts.hostname}/{path}")


def repository_id(git_url: str) -> str:
    """A repository entry's id: derived from its URL (as hoop.dev does), so that the same URL is the same entry."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, git_url.strip()))


def check_branch(branch: str) -> str:
    if branch and not _BRANCH.match(branch):
        raise RunbookError("branch: not a branch name")
    return branch


def check_folder(folder: str) -> str:
    folder = folder.strip().strip("/")
    if folder and (".." in folder.split("/") or "\\" in folder or "\0" in folder):
        raise RunbookError("folder: expected a path inside the repository")
    return folder


@dataclass(slots=True)
class RunbookFile:
    """One runbook of a commit: its path, its text and what its template declares (or why it cannot render)."""

    name: str
    text: str
    template: Template | None
    error: str | None = None


@dataclass(slots=True)
class Catalog:
    """The runbooks of one repository at one commit."""

    repository: str
    commit: str
    author: str
    message: str
    files: dict[str, RunbookFile] = field(default_factory=dict)


def may_run(rules: list[RunbookRule], user: User, repository: str, name: str, connection: str) -> bool:
    """Whether ``user`` may run runbook ``name`` of ``repository`` on ``connection``.

    Admins may run everything; without rules everyone may. Otherwise a rule must name the runbook (or none),
    the connection (or none) and one of the user's groups (or none).
    """
    if ADMIN_GROUP in user.groups or not rules:
        return True
    groups = set(user.groups)
    for rule in rules:
        if rule.runbooks and not any(r.get("repository") == repository and r.get("name") == name
                                     for r in rule.runbooks):
            continue
        if rule.connections and connection not in rule.connections:
            continue
        if rule.user_groups and not groups & set(rule.user_groups):
            continue
        return True
    return False


def in_folders(name: str, folders: Iterable[str]) -> bool:
    """Whether runbook ``name`` is under one of ``folders`` (no folder: any)."""
    prefixes = [f.strip("/") for f in folders if f.strip("/")]
    return not prefixes or any(name == p or name.startswith(p + "/") for p in prefixes)


class GitFailed(Exception):
    """A git command failed; the message is git's, with nothing secret in it."""


class RunbookService:
    """Fetches the organizations' runbook repositories and keeps what each commit holds."""

    def __init__(self, data_dir: Path, *, refresh_interval: float = 300.0, timeout: float = 60.0,
                 tenant_policy: AddressPolicy | None = None) -> None:
        self.root = data_dir / "runbooks"
        self.refresh_interval = refresh_interval
        self.timeout = timeout
        self.tenant_policy = tenant_policy or AddressPolicy()
        self._catalogs: OrderedDict[tuple[str, str], Catalog] = OrderedDict()  # (clone path, commit) -> catalog
        self._tips: dict[str, tuple[str, float, str]] = {}  # clone path -> (commit, fetched at, fetch key)
        self._locks: dict[str, asyncio.Lock] = {}

    # -- git

    def _clone_dir(self, repo: RunbookRepository) -> Path:
        return self.root / repo.org_id / f"{repo.id}.git"

    def _askpass(self) -> Path:
        path = self.root / "askpass.sh"
        if not path.exists():
            self.root.mkdir(parents=True, exist_ok=True)
            fd, scratch = tempfile.mkstemp(dir=self.root, prefix=".askpass-")
            with os.fdopen(fd, "w") as handle:
                handle.write(_ASKPASS)
            os.chmod(scratch, 0o700)
            os.replace(scratch, path)
        return path

    def _git(self, args: list[str], env: dict[str, str], cwd: Path | None = None, input: bytes | None = None,
             config: list[str] | None = None) -> bytes:
        """``git <args>`` in a child process (in the calling thread); its stdout, or GitFailed with its stderr."""
        command = ["git", "-c", "gc.auto=0", "-c", "core.hooksPath=/dev/null", "-c", "protocol.allow=never",
                   "-c", "protocol.https.allow=always", "-c", "protocol.http.allow=always",
                   "-c", "protocol.ssh.allow=always", "-c", "credential.helper=", *(config or []), *args]
        try:
            done = subprocess.run(command, cwd=cwd, env=env, input=input, capture_output=True,
                                  timeout=self.timeout, check=False)
        except subprocess.TimeoutExpired:
            raise GitFailed(f"git {args[0]} did not finish within {self.timeout:g} s") from None
        if done.returncode != 0:
            lines = [line for line in done.stderr.decode("utf-8", "replace").splitlines() if line.strip()]
            raise GitFailed(lines[-1].removeprefix("fatal: ").strip() if lines else f"git {args[0]} failed")
        return done.stdout

    def _environment(self, scratch: Path) -> dict[str, str]:
        return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(scratch), "GIT_TERMINAL_PROMPT": "0",
                "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull, "LC_ALL": "C",
                "GIT_ASKPASS": str(self._askpass()), "GATEWAYD_GIT_USERNAME": "", "GATEWAYD_GIT_SECRET": ""}

    def _remote(self, repo: RunbookRepository, location: Location, scratch: Path, env: dict[str, str],
                tenant: bool) -> tuple[str, list[str]]:
        """The URL git fetches from and the settings it needs (credentials go into ``env`` and files in
        ``scratch``), pinned to a checked address for a tenant."""
        config: list[str] = []
        url = repo.git_url.strip()
        password = repo.credentials.get("git_password", "")
        if location.scheme in ("https", "http"):
            if password:
                if location.scheme == "http" and not _loopback(location.host):
                    raise RunbookError("git_password: a password is only sent over https (or to this host)")
                env["GATEWAYD_GIT_USERNAME"] = repo.git_user or "git"
                env["GATEWAYD_GIT_SECRET"] = password
            config += ["-c", "http.followRedirects=false"]
        elif location.scheme == "ssh":
            key = repo.credentials.get("ssh_key", "")
            known = scratch / "known_hosts"
            known.write_text(repo.ssh_known_hosts.strip() + "\n")
            ssh = ["ssh", "-F", os.devnull, "-o", "BatchMode=no", "-o", "StrictHostKeyChecking=yes",
                   "-o", f"UserKnownHostsFile={known}", "-o", "GlobalKnownHostsFile=/dev/null",
                   "-o", "IdentitiesOnly=yes"]
            if key:
                path = scratch / "id"
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as handle:
                    handle.write(key.strip() + "\n")
                ssh += ["-i", str(path)]
                env["GATEWAYD_GIT_SECRET"] = repo.credentials.get("ssh_keypass", "")
                env.update(SSH_ASKPASS=env["GIT_ASKPASS"], SSH_ASKPASS_REQUIRE="force", DISPLAY=":0")
            if repo.ssh_user:
                ssh += ["-l", repo.ssh_user]
            env["GIT_SSH_COMMAND"] = " ".join(_shell_word(word) for word in ssh)
        else:
            config += ["-c", "protocol.file.allow=always"]
        if tenant:
            address = self._checked_address(location)
            if location.scheme in ("https", "http"):
                config += ["-c", f"http.curloptResolve={location.host}:{location.port}:{address}"]
            else:
                env["GIT_SSH_COMMAND"] += f" -o HostKeyAlias={_shell_word(location.host)} -o HostName={address}"
        return url, config

    def _checked_address(self, location: Location) -> str:
        """The first address of the repository's host that the tenant policy allows (RunbookError if none)."""
        if location.scheme not in ("https", "ssh"):
            raise RunbookError("git_url: an organization's repository is reached over https or ssh")
        try:
            infos = socket.getaddrinfo(location.host, location.port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise RunbookError(f"git_url: cannot resolve {location.host}: {exc.strerror or exc}") from None
        refused = ""
        for *_, address in infos:
            why = self.tenant_policy.refusal(str(address[0]))
            if why is None:
                return str(address[0])
            refused = refused or why
        raise RunbookError(f"git_url: {location.host} is {refused}: not reachable for an organization", 422)

    def _fetch(self, repo: RunbookRepository, location: Location, tenant: bool) -> str:
        """Fetch the branch into the repository's clone (made on first use); the commit at its tip."""
        clone = self._clone_dir(repo)
        clone.parent.mkdir(parents=True, exist_ok=True)
        with open(f"{clone}.lock", "w") as lock, tempfile.TemporaryDirectory(dir=self.root) as scratch_dir:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the workers of a node share the clone
            scratch = Path(scratch_dir)
            env = self._environment(scratch)
            url, config = self._remote(repo, location, scratch, env, tenant)
            if not (clone / "HEAD").exists():
                self._git(["init", "--bare", "--quiet", str(clone)], env)
            source = f"refs/heads/{repo.branch}" if repo.branch else "HEAD"
            self._git(["fetch", "--quiet", "--no-tags", "--prune", "--", url, f"+{source}:refs/gatewayd/tip"], env,
                      cwd=clone, config=config)
            return self._git(["rev-parse", "--verify", "refs/gatewayd/tip^{commit}"], env, cwd=clone).decode().strip()

    def _read(self, repo: RunbookRepository, commit: str) -> Catalog:
        """What ``commit`` of the clone holds under the repository's folder (GitFailed if the commit is not there)."""
        clone = self._clone_dir(repo)
        with tempfile.TemporaryDirectory(dir=self.root) as scratch:
            env = self._environment(Path(scratch))
            resolved = self._git(["rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}"], env,
                                 cwd=clone).decode().strip()
            head = self._git(["log", "-1", "--format=%an <%ae>%x00%s", resolved], env, cwd=clone).decode()
            author, _, message = head.rstrip("\n").partition("\0")
            listing = ["ls-tree", "-r", "-z", "--name-only", resolved]
            folder = check_folder(repo.folder)
            if folder:
                listing += ["--", folder + "/"]
            names = [n for n in self._git(listing, env, cwd=clone).decode("utf-8", "replace").split("\0")
                     if n and RUNBOOK_MARK in n.rsplit("/", 1)[-1]][:MAX_FILES]
            catalog = Catalog(repo.repository, resolved, author, message)
            if not names:
                return catalog
            batch = self._git(["cat-file", "--batch"], env, cwd=clone,
                              input="".join(f"{resolved}:{n}\n" for n in names).encode())
        pos = 0
        for name in names:
            end = batch.index(b"\n", pos)
            header = batch[pos:end].split()
            size = int(header[2]) if len(header) == 3 else 0
            content = batch[end + 1:end + 1 + size]
            pos = end + 1 + size + 1
            if size > MAX_FILE_BYTES:
                catalog.files[name] = RunbookFile(name, "", None, f"larger than {MAX_FILE_BYTES} bytes")
                continue
            try:
                text = content.decode("utf-8")
            except UnicodeDecodeError:
                catalog.files[name] = RunbookFile(name, "", None, "not UTF-8 text")
                continue
            try:
                catalog.files[name] = RunbookFile(name, text, parse(text))
            except TemplateError as exc:
                catalog.files[name] = RunbookFile(name, text, None, str(exc))
        return catalog

    # -- what callers use

    def _lock(self, key: str) -> asyncio.Lock:
        return self._locks.setdefault(key, asyncio.Lock())

    @staticmethod
    def _fetch_key(repo: RunbookRepository) -> str:
        """What a clone's last fetch depended on: a changed configuration fetches again."""
        return "\0".join((repo.git_url, repo.branch, repo.git_user, repo.ssh_user, repo.ssh_known_hosts,
                          repo.updated_at))

    async def catalog(self, repo: RunbookRepository, *, refresh: bool = False, tenant: bool = False) -> Catalog:
        """The runbooks at the tip of the repository's branch, fetched when due (or ``refresh``).

        ``tenant``: the repository is a tenant's (no local path; only addresses its policy allows)."""
        location = locate(repo.git_url, local_allowed=not tenant)
        clone = str(self._clone_dir(repo))
        async with self._lock(clone):
            tip = self._tips.get(clone)
            due = (tip is None or refresh or tip[2] != self._fetch_key(repo)
                   or time.monotonic() - tip[1] >= self.refresh_interval)
            if due:
                try:
                    commit = await asyncio.to_thread(self._fetch, repo, location, tenant)
                except GitFailed as exc:
                    raise RunbookError(f"cannot fetch {repo.repository}: {exc}", 502) from None
                self._tips[clone] = (commit, time.monotonic(), self._fetch_key(repo))
                log.info("runbooks fetched", extra={"repository": repo.repository, "commit": commit,
                                                    "org_id": repo.org_id})
            else:
                commit = tip[0]  # type: ignore[index]
        return await self.at_commit(repo, commit, tenant=tenant)

    async def at_commit(self, repo: RunbookRepository, commit: str, *, tenant: bool = False) -> Catalog:
        """The runbooks as ``commit`` has them (fetched once more if the clone does not have it yet)."""
        if not _SHA.match(commit):
            raise RunbookError("ref_hash: expected a commit hash", 422)
        clone = str(self._clone_dir(repo))
        for key in list(self._catalogs):
            if key[0] == clone and key[1].startswith(commit):
                self._catalogs.move_to_end(key)
                return self._catalogs[key]
        try:
            catalog = await asyncio.to_thread(self._read, repo, commit)
        except (GitFailed, FileNotFoundError):
            if clone not in self._tips:  # a fresh process: the commit may only need a fetch
                await self.catalog(repo, refresh=True, tenant=tenant)
                try:
                    catalog = await asyncio.to_thread(self._read, repo, commit)
                except (GitFailed, FileNotFoundError):
                    catalog = None
            else:
                catalog = None
            if catalog is None:
                raise RunbookError(f"commit {commit} is not in {repo.repository}", 404) from None
        assert catalog is not None
        self._catalogs[(clone, catalog.commit)] = catalog
        while len(self._catalogs) > CATALOGS_KEPT:
            self._catalogs.popitem(last=False)
        return catalog

    def forget(self, repo: RunbookRepository) -> None:
        """Drop what is known of a repository entry (changed or deleted): the next use fetches again."""
        clone = str(self._clone_dir(repo))
        self._tips.pop(clone, None)
        for key in [k for k in self._catalogs if k[0] == clone]:
            del self._catalogs[key]


def _loopback(host: str) -> bool:
    return host in ("localhost", "127.0.0.1", "::1") or host.startswith("127.")


def _shell_word(word: str) -> str:
    """``word`` quoted for the shell git runs ``GIT_SSH_COMMAND`` with."""
    return "'" + word.replace("'", "'\\''") + "'"
