"""`python -m recover.cli`: the `recover` command."""

import sys

from recover.cli import main

sys.exit(main())
