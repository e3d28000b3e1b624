"""The per-step progress bar of dpzoo's long jobs: training runs, DP-FROST selection, audits.

One tqdm bar of steps with the last loss and the ε spent so far. It is hidden when stderr is not
a terminal (``enabled=None``, tqdm's own test) or when the caller asks (``enabled=False``).
Refreshing the text costs little, but an accountant can take a while (PLD: tens of ms), so the
loss is shown at most once a second and ε at most once a second and at most 10% of the time.
"""

from __future__ import annotations

import math
import time
from typing import Callable

from tqdm import tqdm

__all__ = ["StepBar"]


class StepBar:
    """``total`` steps named ``desc``; :meth:`step` after each one (``loss``: a tensor or a number,
    or None), :meth:`say` for a line that must not break the bar, :meth:`close` at the end (or
    use it as a context manager). ``epsilon()``: the ε spent so far (None: no ε shown)."""

    def __init__(
        self,
        total: int,
        desc: str,
        *,
        enabled: bool | None = None,
        epsilon: Callable[[], float | None] | None = None,
        initial: int = 0,
        unit: str = "step",
    ):
        self.bar = tqdm(
            total=total,
            initial=initial,
            desc=desc,
            unit=unit,
            disable=None if enabled is None else not enabled,
            dynamic_ncols=True,
        )
        self.epsilon = epsilon
        self.done = initial
        self._shown = self._eps_shown = -math.inf
        self._eps_cost = 0.0
        self._eps_text = ""

    @property
    def visible(self) -> bool:
        return not self.bar.disable

    def step(self, loss=None) -> None:
        """One step done; ``loss`` the last batch's (shown with ε, throttled as the module says)."""
        self.done += 1
        if not self.visible:
            return
        self.bar.update(1)
        now = time.monotonic()
        last = self.done >= (self.bar.total or 0)
        if now - self._shown < 1.0 and not last:
            return
        self._shown = now
        shown = {}
        if loss is not None:
            shown["loss"] = f"{float(loss):.4g}"
        if self.epsilon is not None:
            if last or now - self._eps_shown >= max(1.0, 10 * self._eps_cost):
                started = time.monotonic()
                eps = self.epsilon()
                self._eps_text = "" if eps is None else f"{eps:.3g}"
                self._eps_shown, self._eps_cost = now, time.monotonic() - started
            if self._eps_text:
                shown["ε"] = self._eps_text
        self.bar.set_postfix(shown, refresh=False)

    def say(self, message: str, log: Callable[[str], None] = print) -> None:
        """``log(message)`` without tearing the bar."""
        if self.visible:
            with tqdm.external_write_mode():
                log(message)
        else:
            log(message)

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> "StepBar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
