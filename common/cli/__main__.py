"""`python -m omnistage.common.cli`: the `omnistage` command."""

import sys

from omnistage.common.cli.commands import main

sys.exit(main())
