"""Autocast off while per-sample norms and clipped sums are formed.

``torch.autocast`` casts every matrix product to float16 / bfloat16, including dpzoo's own when
they run inside the user's autocast region: ``optimizer.step()`` called in the ``with`` block, or
a micro-batch clipped when the next forward starts (gradient accumulation). There a float16 Gram
matrix underflows (a norm reads 0: the sample goes unclipped), overflows (every sample dropped
under a loss scale) or rounds a clip weight up, so the per-sample bound fails. Under
:func:`no_autocast` the representations, already formed in float32 or better
(``assembly.common_dtype``), are multiplied in their own dtype.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager

import torch

__all__ = ["no_autocast", "AUTOCAST_DEVICES"]

AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")


def _enabled(device_type: str) -> bool:
    try:
        return bool(torch.is_autocast_enabled(device_type))
    except (RuntimeError, TypeError, ValueError):  # a device type this torch build does not know
        return False


@contextmanager
def no_autocast():
    """Turn autocast off (on every device type where it is on) for the duration; also a decorator."""
    with ExitStack() as stack:
        for device_type in AUTOCAST_DEVICES:
            if _enabled(device_type):
                stack.enter_context(torch.autocast(device_type, enabled=False))
        yield
