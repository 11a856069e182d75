"""A git server for the tests: real repositories served over smart HTTP by ``git http-backend`` (CGI).

``GitServer`` runs a small threaded HTTP server that hands each request to git's own ``http-backend``
(as a web server's CGI would), behind HTTP Basic authentication when a user and password are set. Tests
commit to a work tree (``GitServer.commit``) and push nothing: the served repository is the work tree's
own ``.git``, exported as ``<name>.git``.
"""

from __future__ import annotations

import base64
import os
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tests.ports import free_port

HTTP_BACKEND = "/usr/lib/git-core/git-http-backend"
_GIT_ENV = {"GIT_AUTHOR_NAME": "Rita Runbook", "GIT_AUTHOR_EMAIL": "rita@example.com",
            "GIT_COMMITTER_NAME": "Rita Runbook", "GIT_COMMITTER_EMAIL": "rita@example.com",
            "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull}


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, env={**os.environ, **_GIT_ENV}, check=True,
                          capture_output=True, text=True).stdout.strip()


class GitServer:
    """``http://127.0.0.1:<port>/<name>.git`` for each repository made with ``repository``."""

    def __init__(self, root: Path, user: str = "", password: str = "") -> None:
        self.root = root
        self.user, self.password = user, password
        self.port = free_port()
        self.requests: list[tuple[str, str, str]] = []  # (method, path, user who authenticated)
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                self._cgi()

            def do_POST(self) -> None:
                self._cgi()

            def _cgi(self) -> None:
                who = ""
                if server.user:
                    scheme, _, encoded = self.headers.get("Authorization", "").partition(" ")
                    expected = base64.b64encode(f"{server.user}:{server.password}".encode()).decode()
                    if scheme != "Basic" or encoded != expected:
                        server.requests.append((self.command, self.path, "refused"))
                        self.send_response(401)
                        self.send_header("WWW-Authenticate", 'Basic realm="git"')
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    who = server.user
                server.requests.append((self.command, self.path, who))
                path, _, query = self.path.partition("?")
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                env = {"PATH": os.environ["PATH"], "GIT_PROJECT_ROOT": str(server.root), "GIT_HTTP_EXPORT_ALL": "1",
                       "REQUEST_METHOD": self.command, "PATH_INFO": path, "QUERY_STRING": query,
                       "CONTENT_TYPE": self.headers.get("Content-Type", ""), "CONTENT_LENGTH": str(len(body)),
                       "REMOTE_USER": who, "REMOTE_ADDR": "127.0.0.1", "GIT_CONFIG_NOSYSTEM": "1",
                       "GIT_CONFIG_GLOBAL": os.devnull, "HTTP_GIT_PROTOCOL": self.headers.get("Git-Protocol", "")}
                done = subprocess.run([HTTP_BACKEND], input=body, env=env, capture_output=True, check=False)
                head, _, payload = done.stdout.partition(b"\r\n\r\n")
                status = 200
                headers = []
                for line in head.decode("latin-1").split("\r\n"):
                    name, _, value = line.partition(":")
                    if name.lower() == "status":
                        status = int(value.strip().split()[0])
                    elif name:
                        headers.append((name, value.strip()))
                self.send_response(status)
                for name, value in headers:
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def start(self) -> "GitServer":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}.git"

    def repository(self, name: str, branch: str = "main") -> Path:
        """A new repository (a work tree served as ``<name>.git``) with nothing committed yet."""
        tree = self.root / f"{name}.work"
        tree.mkdir(parents=True)
        git(tree, "init", "--quiet", "-b", branch)
        (self.root / f"{name}.git").symlink_to(tree / ".git")
        return tree

    @staticmethod
    def commit(tree: Path, files: dict[str, str | None], message: str = "runbooks") -> str:
        """Write (or, for None, remove) ``files`` in ``tree`` and commit them; the new commit's hash."""
        for name, text in files.items():
            path = tree / name
            if text is None:
                path.unlink()
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        git(tree, "add", "--all")
        git(tree, "commit", "--quiet", "-m", message)
        return git(tree, "rev-parse", "HEAD")
