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
    from gatewayd import logs
    from launcher.root import run

    config = cli.load(args.config)
    logs.configure(config["log.format"], config["log.level"])
    cli.run_loop(run(config))
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.main(argv, run=_cmd_run)


if __name__ == "__main__":
    sys.exit(main())
