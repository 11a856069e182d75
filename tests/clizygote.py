"""The ``gatewayd`` command with its imports done once: a fork per call instead of a Python start per call.

A host command (``gatewayd token create`` ...) spends about a second starting Python and importing the
daemon's modules, and a few milliseconds doing its work; the end-to-end tests mint a token that way
about a hundred times. This process (``python -m tests.clizygote SOCKET``, started once per test session
by ``tests/conftest.py``) imports ``launcher.cli`` and then, for each request on its Unix socket, forks
a child that runs ``launcher.cli.main`` -- the console script's own entry point -- with the request's
argv, environment, working directory, stdin, stdout and stderr, and answers its exit status the way the
console script's ``sys.exit(main())`` would. The zygote never runs an event loop or a thread of its
own, so a fork starts from the state a fresh ``gatewayd`` process has after its imports.

Protocol, one connection per call: the client sends one JSON line ``{argv, env, cwd, stdin, stdout,
stderr}`` (the last three are file paths); the child answers ``pid N`` then, when done, ``exit N``.
The zygote exits when its stdin closes (the test session ended).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import traceback


def _exit_status(code: object) -> int:
    """What the interpreter exits with for ``sys.exit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _child(conn: socket.socket, request: dict) -> None:
    """Become the ``gatewayd`` process of one call; never returns."""
    status = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the command's own subprocesses are waited for
        signal.signal(signal.SIGINT, signal.default_int_handler)
        conn.sendall(f"pid {os.getpid()}\n".encode())
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for fd, (path, flags) in enumerate(((request["stdin"], os.O_RDONLY),
                                            (request["stdout"], os.O_WRONLY | os.O_TRUNC),
                                            (request["stderr"], os.O_WRONLY | os.O_TRUNC))):
            opened = os.open(path, flags)
            os.dup2(opened, fd)
            os.close(opened)
        sys.argv = list(request["argv"])
        from launcher.cli import main

        try:
            status = _exit_status(main(sys.argv[1:]))
        except SystemExit as exc:  # argparse's usage errors, a command's own sys.exit
            status = _exit_status(exc.code)
        except BaseException:  # what the interpreter does with an uncaught exception
            traceback.print_exc()
            status = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
        conn.sendall(f"exit {status}\n".encode())
    finally:
        os._exit(status)


def serve(path: str) -> None:
    # the point of this process: the imports a command does, done once (the host commands import the core's
    # Gateway and the people's commands their client on first use)
    import gatewayd.client.commands  # noqa: F401
    import gatewayd.daemon  # noqa: F401
    import gatewayd.store.postgres  # noqa: F401
    import gatewayd.store.sqlite  # noqa: F401
    import launcher.cli  # noqa: F401

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    print("ready", flush=True)
    while True:
        readable, _, _ = select.select([server, sys.stdin], [], [])
        if sys.stdin in readable and not sys.stdin.readline():
            return  # the test session closed our stdin
        if server in readable:
            conn, _ = server.accept()
            with conn:
                reader = conn.makefile("rb")
                line = reader.readline()
                reader.close()
                if not line:
                    continue
                if os.fork() == 0:
                    server.close()
                    _child(conn, json.loads(line))


if __name__ == "__main__":
    serve(sys.argv[1])
