"""`python -m dpzoo`: the command line (dpzoo.cli)."""

import sys

from .cli import main

sys.exit(main())
