"""``python -m launcher``: the ``gatewayd`` command."""

import sys

from launcher.cli import main

sys.exit(main())
