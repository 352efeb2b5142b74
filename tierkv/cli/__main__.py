"""`python -m tierkv.cli`: the `tierkv` command."""

import sys

from tierkv.cli.app import main

sys.exit(main())
