import sys

from gatewayd.cli import main

sys.exit(main())
