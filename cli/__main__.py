"""`python -m pcgtts.cli`: the `pcgtts` command, for when its script is not on PATH."""

import sys

from pcgtts.cli import main

sys.exit(main())
