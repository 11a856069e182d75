"""The ``gatewayd`` command: registers the protocols, then runs the daemon or one of the host commands.

``run`` is the composition root's (launcher.root); the host commands (tokens,
local users, verification) and the people's commands live in gatewayd.cli.
"""

from __future__ import annotations

import argparse
import sys

import proxies  # noqa: F401  registers every protocol's description before any configuration is loaded
from gatewayd import cli


def _cmd_run(args: argparse.Namespace) -> int:
    """One gateway process, or with ``[daemon] workers`` above 1 the supervisor of that many (launcher.supervisor)."""
    from gatewayd import logs
    from launcher import supervisor
    from launcher.root import run

    config = cli.load(args.config)
    logs.configure(config["log.format"], config["log.level"])
    index = supervisor.worker_index()
    if index is None and config["daemon.workers"] > 1:
        return supervisor.supervise(config, config["daemon.workers"], args.config)
    if index is not None:
        supervisor.become_worker(index)
    cli.run_loop(run(config, worker_index=index))
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.main(argv, run=_cmd_run)


if __name__ == "__main__":
    sys.exit(main())
