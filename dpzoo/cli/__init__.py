"""The ``dpzoo`` command line: one module per command and per family of options.

:mod:`~dpzoo.cli.commands` (the parser, the small commands, one-line errors), :mod:`~dpzoo.cli.train`
(``dpzoo train``: its options and the run) with :mod:`~dpzoo.cli.image`, :mod:`~dpzoo.cli.seqrec`,
:mod:`~dpzoo.cli.kinds` and :mod:`~dpzoo.cli.config`; :mod:`~dpzoo.cli.evaluate` (``dpzoo eval``),
:mod:`~dpzoo.cli.audit` (``dpzoo audit``); :mod:`~dpzoo.cli.args` (checked values) and
:mod:`~dpzoo.cli.choices` (what ``--help`` lists, without importing torch).
"""

from .commands import build_parser, main, run

__all__ = ["build_parser", "main", "run"]
