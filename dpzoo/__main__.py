"""`python -m dpzoo`: the command line (dpzoo.cli)."""

import sys

from .cli import run

sys.exit(run())
