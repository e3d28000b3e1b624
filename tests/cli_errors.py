"""The command line's bad-input contract, shared by the CLI tests (test-only, not dpzoo's API)."""

from __future__ import annotations

from dpzoo.cli import main


def one_line_error(capsys, argv) -> str:
    """Run the CLI; it must fail with exit code 2 and exactly one ``dpzoo: error:`` line on stderr."""
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's errors exit by themselves
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dpzoo: error: "), err
    return lines[0]
