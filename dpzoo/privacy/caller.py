"""Where a warning points: the first frame of the user's code, outside the dpzoo package."""

from __future__ import annotations

import pathlib
import sys

__all__ = ["first_frame_outside_dpzoo"]

PACKAGE_DIR = str(pathlib.Path(__file__).resolve().parents[1])


def first_frame_outside_dpzoo(also: tuple[str, ...] = ()) -> int:
    """The ``stacklevel`` of the first caller outside the dpzoo package (make_private is reached
    through wrappers such as make_private_with_epsilon, so a fixed level would point inside) and
    outside the directories ``also`` (torch's optimizer wraps ``step`` in its own frames)."""
    inside = (PACKAGE_DIR, *also)
    frame, level = sys._getframe(1), 1
    while frame is not None and str(pathlib.Path(frame.f_code.co_filename).resolve()).startswith(inside):
        frame, level = frame.f_back, level + 1
    return level
