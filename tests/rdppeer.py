"""The RDP peers for tests: Xvfb displays, FreeRDP shadow servers and an observing pyrdp-mitm, as subprocesses.

``Peers`` starts them on free ports and X displays and stops them by process
group.  ``start_peers`` is what the session-scoped ``rdp_peers`` fixture of
conftest.py starts once for every module that needs them: an Xvfb desktop
with the ``-retro`` pattern shared by ``freerdp-shadow-cli`` (TLS security,
no authentication), a second shadow server that insists on NLA and knows one
account (``NLA_USER``/``NLA_PASSWORD``, in a SAM file), an Xvfb display for
the client, and ``pyrdp-mitm`` in front of the first shadow server (its log
shows what reached the target).

FreeRDP 2's shadow server has no clipboard (no ``cliprdr`` server): the
clipboard's target is xrdp in front of an Xvnc desktop
(``Peers.xrdp_desktop``, started by the tests that need it), whose
``xrdp-chansrv`` joins the desktop's X selections to the RDP clipboard;
``xclip`` sets and reads the selection on either side.
"""

from __future__ import annotations

import os
import select
import socket
import shutil
import signal
import subprocess
import time
from pathlib import Path

from tests.conftest import BIN, free_port, wait_port

PEER_TOOLS = ("Xvfb", "freerdp-shadow-cli", "xfreerdp")
XRDP_TOOLS = ("xrdp", "xrdp-chansrv", "Xvnc", "xclip")  # the xrdp target, and the X selections' tool
XRDP_SOCKETS = Path("/run/xrdp/sockdir")  # where xrdp finds xrdp-chansrv (its build's --with-socketdir)
NLA_USER, NLA_PASSWORD = "alice", "Tgt-pass-7c1e9d"  # the one account of the NLA shadow server
# pyrdp's own pyrdp-mitm command, after proxies.rdp's compatibility shim (Python 3.13 removed typing.io)
PYRDP_MITM = "import sys, proxies.rdp; from pyrdp.bin.mitm import main; sys.argv[0] = 'pyrdp-mitm'; sys.exit(main())"


def wait_x_display(display: int, timeout: float = 20) -> None:
    """Until the X server of ``display`` accepts a connection on its socket (a bound, then on regardless)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket(socket.AF_UNIX) as probe:
            try:
                probe.connect(f"/tmp/.X11-unix/X{display}")
                return
            except OSError:
                time.sleep(0.1)


class Peers:
    """Xvfb displays, shadow servers and the observing pyrdp-mitm, as subprocesses."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.home = root / "home"
        self.home.mkdir()
        self.processes: list[subprocess.Popen[bytes]] = []

    def spawn(self, args: list[str], name: str, env: dict[str, str] | None = None,
              pass_fds: tuple[int, ...] = ()) -> subprocess.Popen[bytes]:
        log = open(self.root / f"{name}.log", "ab")
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=self.root,
                                   env={"PATH": os.environ["PATH"], "HOME": str(self.home), **(env or {})},
                                   start_new_session=True, pass_fds=pass_fds)
        log.close()
        self.processes.append(process)
        return process

    def log(self, name: str) -> str:
        path = self.root / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def display(self, name: str, size: str, *extra: str, server: tuple[str, ...] = ()) -> int:
        """A new Xvfb display (or ``server``'s: Xvnc); its number, once it accepts clients.

        Xvfb picks a free number itself (``-displayfd``, under its own lock files) and writes it when ready:
        a number chosen here from the lock files could be taken meanwhile by another test run's Xvfb."""
        read, write = os.pipe()
        screen = ("-screen", "0", size) if not server else ()
        command = [*(server or ("Xvfb",)), "-displayfd", str(write), *screen, "-nolisten", "tcp", *extra]
        try:
            process = self.spawn(command, name, pass_fds=(write,))
        finally:
            os.close(write)
        answer = b""
        deadline = time.monotonic() + 20
        try:
            while not answer.endswith(b"\n"):
                ready, _, _ = select.select([read], [], [], max(deadline - time.monotonic(), 0))
                chunk = os.read(read, 16) if ready else b""
                if not chunk:  # Xvfb exited (end of file) or time ran out
                    raise RuntimeError(f"Xvfb did not start:\n{self.log(name)}")
                answer += chunk
        finally:
            os.close(read)
        if process.poll() is not None:
            raise RuntimeError(f"Xvfb :{answer.decode().strip()} exited:\n{self.log(name)}")
        return int(answer)

    def shadow(self, display: int, name: str, *security: str) -> int:
        attempts = 4
        for attempt in range(attempts):  # right after Xvfb (on a busy machine) the shadow server can fail to open it
            wait_x_display(display)
            port = free_port()
            process = self.spawn(["freerdp-shadow-cli", f"/port:{port}", "/bind-address:127.0.0.1", *security],
                                 name, {"DISPLAY": f":{display}"})
            try:
                wait_port(port, process, "freerdp-shadow-cli")
                return port
            except RuntimeError:
                if attempt == attempts - 1:
                    raise RuntimeError(f"freerdp-shadow-cli did not start:\n{self.log(name)}") from None
                process.kill()
                time.sleep(attempt + 1)
        raise AssertionError("unreachable")

    def observer(self, target_port: int) -> int:
        port = free_port()
        process = self.spawn([str(BIN / "python"), "-c", PYRDP_MITM, f"127.0.0.1:{target_port}", "-a", "127.0.0.1", "-l", str(port),
                              "-o", str(self.root / "observer")], "observer")
        wait_port(port, process, "pyrdp-mitm (observer)", timeout=30)
        return port

    def xrdp_desktop(self) -> int:
        """An Xvnc desktop behind xrdp (TLS, no logon: its VNC needs none), with the clipboard; xrdp's port.

        Started once, on first use (``desktop_display`` is the desktop's X display, for ``xclip``)."""
        if getattr(self, "xrdp_port", None):
            return int(self.xrdp_port)
        root = self.root / "xrdp"
        root.mkdir()
        vnc_port = free_port()
        display = self.display("xvnc", "", server=("Xvnc", "-geometry", "1024x768", "-depth", "24", "-rfbport",
                                                   str(vnc_port), "-SecurityTypes", "None", "-localhost"))
        wait_port(vnc_port, what="Xvnc")
        XRDP_SOCKETS.mkdir(parents=True, exist_ok=True)
        self.spawn(["xrdp-chansrv"], "xrdp-chansrv", {"DISPLAY": f":{display}"})
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=xrdp",
                        "-keyout", str(root / "key.pem"), "-out", str(root / "cert.pem")], check=True,
                       capture_output=True)
        port = free_port()
        (root / "xrdp.ini").write_text(XRDP_INI.format(port=port, root=root, vnc_port=vnc_port, display=display))
        process = self.spawn(["xrdp", "--nodaemon", "--config", str(root / "xrdp.ini")], "xrdp")
        wait_port(port, process, "xrdp")
        self.desktop_display, self.xrdp_port = display, port
        return port

    def stop(self) -> None:
        for process in reversed(self.processes):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


# xrdp's configuration for the clipboard's target: one session, the Xvnc desktop, straight away; its channels
# through the xrdp-chansrv of that display
XRDP_INI = """[Globals]
port=tcp://127.0.0.1:{port}
security_layer=tls
certificate={root}/cert.pem
key_file={root}/key.pem
ssl_protocols=TLSv1.2, TLSv1.3
crypt_level=none
autorun=desktop
allow_channels=true
max_bpp=32
fork=false

[Logging]
LogFile={root}/xrdp-own.log
LogLevel=INFO
EnableSyslog=false

[Channels]
cliprdr=true
rdpdr=true
rdpsnd=true
drdynvc=true

[desktop]
name=desktop
lib=libvnc.so
username=na
password=na
ip=127.0.0.1
port={vnc_port}
chansrvport=DISPLAY({display})
"""


def unavailable_reason() -> str | None:
    """Why the RDP peers cannot run here, or None."""
    missing = [tool for tool in PEER_TOOLS if shutil.which(tool) is None]
    if missing:
        return f"RDP peers not installed ({', '.join(missing)}): run scripts/install-peers.sh"
    if not (BIN / "pyrdp-mitm").exists():
        return "pyrdp-mitm is not installed (make installs it: pip install --no-deps pyrdp-mitm==2.1.0)"
    return None


def xrdp_unavailable_reason() -> str | None:
    """Why the xrdp target (xrdp, Xvnc, and xclip for its clipboard) cannot run here, or None."""
    missing = [tool for tool in XRDP_TOOLS if shutil.which(tool) is None]
    return f"the xrdp target is not installed ({', '.join(missing)}): run scripts/install-peers.sh" \
        if missing else None


def start_peers(root: Path) -> Peers:
    """The desktop, the client display, the shadow servers (TLS, NLA) and the observer; stopped on failure."""
    found = Peers(root)
    try:
        found.desktop = desktop = found.display("xvfb-target", "1024x768x24", "-retro")
        found.client_display = found.display("xvfb-client", "1280x800x24")
        found.shadow_port = found.shadow(desktop, "shadow", "-auth", "/sec:tls")
        found.nla_port = found.shadow(desktop, "shadow-nla", "/sec:nla", f"-sam-file:{sam_file(root)}")
        found.observer_port = found.observer(found.shadow_port)
    except BaseException:
        found.stop()
        raise
    return found


def sam_file(root: Path) -> Path:
    """The NLA shadow server's accounts, in winpr's SAM: ``user:domain:LM hash:NT hash:::``.

    The NT hash is MD4 of the UTF-16LE password; the domain is empty (a
    line ``user:::LM:NT:::`` would put the LM hash where the NT hash goes).
    """
    from Crypto.Hash import MD4

    path = root / "nla.sam"
    nt_hash = MD4.new(NLA_PASSWORD.encode("utf-16-le")).hexdigest()
    path.write_text(f"{NLA_USER}::aad3b435b51404eeaad3b435b51404ee:{nt_hash}:::\n")
    return path
