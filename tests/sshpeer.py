"""A real OpenSSH sshd for tests and benchmarks, and the real OpenSSH clients to drive things with.

``SshTarget`` runs ``/usr/sbin/sshd -D -e`` on a free port with its own host
key and authorized key in a temp dir, for a dedicated OS user
(``gatewayd-sshtest``, created once when root, with a random password so
both ``PRIVATE_KEY`` and ``PASS`` roles can be tested: one for every target on
the machine, ``shared_password``). It is stopped by PID.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from tests.ports import free_port

SSHD = Path("/usr/sbin/sshd")
USER = "gatewayd-sshtest"
CLIENT_OPTIONS = ["-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                  "-o", "LogLevel=ERROR", "-o", "ConnectTimeout=15", "-F", "/dev/null"]



def unavailable_reason() -> str | None:
    """Why an sshd target cannot run here, or None."""
    if not SSHD.exists():
        return "OpenSSH server not installed (/usr/sbin/sshd; package openssh-server)"
    for tool in ("ssh", "scp", "sftp", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"OpenSSH client tool {tool!r} not installed (package openssh-client)"
    if os.geteuid() != 0:
        return "the sshd target needs root (it logs in a dedicated OS user)"
    return None


def group_alive(pgid: int) -> bool:
    """Whether a process of the process group ``pgid`` still runs on this machine (sshd starts each command in a
    group of its own, whose id is the command's pid: ``echo $$``)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


async def until_gone(*pgids: int) -> None:
    """Until every process of the groups ``pgids`` has ended (bounded: a command left running fails the test)."""
    async with asyncio.timeout(20):
        while any(group_alive(pgid) for pgid in pgids):
            await asyncio.sleep(0.05)


PASSWORD_FILE = Path(tempfile.gettempdir()) / "gatewayd-sshtest.password"


def shared_password() -> str:
    """The test user's password, the same for every target: the OS user is one for the whole machine, and the
    suite starts targets in parallel processes, so a password of each target's own would change under another
    target's tests. Made once (root-only file, put in place whole with ``link``, which refuses an existing one)."""
    try:
        return PASSWORD_FILE.read_text().strip()
    except FileNotFoundError:
        pass
    draft = PASSWORD_FILE.with_name(f"{PASSWORD_FILE.name}.{os.getpid()}")
    draft.write_text(secrets.token_urlsafe(18))
    draft.chmod(0o600)
    try:
        os.link(draft, PASSWORD_FILE)
    except FileExistsError:
        pass  # another process made it first: its password is the one
    finally:
        draft.unlink()
    return PASSWORD_FILE.read_text().strip()


def ensure_user(password: str) -> pwd.struct_passwd:
    """The dedicated target user, with ``password`` (sshd checks it against /etc/shadow with UsePAM no).  One
    process at a time (a lock file): targets start in parallel test processes, and where two both find the user
    missing, both run ``useradd``, and the later one fails (exit status 9: the user exists)."""
    with PASSWORD_FILE.with_suffix(".lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            entry = pwd.getpwnam(USER)
        except KeyError:
            subprocess.run(["useradd", "--system", "--no-create-home", "--home-dir", "/tmp", "--shell", "/bin/bash",
                            USER], check=True, capture_output=True)
            entry = pwd.getpwnam(USER)
        subprocess.run(["chpasswd"], input=f"{USER}:{password}\n", text=True, check=True, capture_output=True)
        return entry


def keygen(path: Path, kind: str = "ed25519") -> Path:
    subprocess.run(["ssh-keygen", "-q", "-t", kind, "-N", "", "-f", str(path)], check=True, capture_output=True)
    return path


class SshTarget:
    """One throw-away sshd."""

    def __init__(self, directory: Path | None = None, client_key: Path | None = None) -> None:
        self.shared_client_key = client_key  # another target's key: one key logs in to both (ProxyJump)
        self.dir = directory or Path(tempfile.mkdtemp(prefix="gatewayd-sshd-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.dir.chmod(0o755)
        self.port = free_port()
        self.user = USER
        self.password = shared_password()
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, password: str | None = None) -> SshTarget:
        self.password = password or self.password
        ensure_user(self.password)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        self.host_key = keygen(self.dir / "host_key")
        self.client_key = self.shared_client_key or keygen(self.dir / "client_key")
        authorized = self.dir / "authorized_keys"
        authorized.write_text(Path(f"{self.client_key}.pub").read_text())
        authorized.chmod(0o644)
        self.config = self.dir / "sshd_config"
        self.config.write_text("\n".join([
            "ListenAddress 127.0.0.1", f"Port {self.port}", f"HostKey {self.host_key}",
            f"PidFile {self.dir / 'sshd.pid'}", f"AuthorizedKeysFile {authorized}", "PasswordAuthentication yes",
            "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no", "PermitRootLogin no",
            "Subsystem sftp internal-sftp", "AllowTcpForwarding yes", "AcceptEnv LANG LC_* GATEWAYD_*",
            "MaxStartups 100:30:200", "MaxSessions 50", "PrintMotd no", "PrintLastLog no", "UseDNS no", "",
        ]))
        self.log_path = self.dir / "sshd.log"
        self.log = open(self.log_path, "ab")
        self.process = subprocess.Popen([str(SSHD), "-f", str(self.config), "-D", "-e"], stdout=self.log,
                                        stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"sshd exited: {self.log_path.read_text(errors='replace')}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("sshd did not start")

    @property
    def host_public_key(self) -> str:
        return (self.dir / "host_key.pub").read_text().strip()

    @property
    def private_key_text(self) -> str:
        return self.client_key.read_text()

    def ssh(self, *args: str, port: int | None = None, user: str | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess[bytes]:
        """OpenSSH ``ssh`` straight to this target with the client key."""
        return subprocess.run(["ssh", *CLIENT_OPTIONS, "-i", str(self.client_key), "-p", str(port or self.port),
                               f"{user or self.user}@127.0.0.1", *args], capture_output=True, timeout=timeout)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        if hasattr(self, "log"):
            self.log.close()

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
