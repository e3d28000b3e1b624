"""The per-step progress bar of dpzoo's long jobs: training runs, DP-FROST selection, audits.

One tqdm bar of steps with the last loss, the ε spent so far and what a step costs: seconds per
step and, when physical batching splits steps, micro-batches per step ("3.2 s/step · 4
micro-batches", both averaged since the text was last refreshed). It is hidden when stderr is not
a terminal (``enabled=None``, tqdm's own test) or when the caller asks (``enabled=False``), and then
does no work. Refreshing the text costs little, but an accountant can take a while (PLD: tens of
ms), so the text is refreshed at most once a second and ε asked for at most once a second and at
most 10% of the time.
"""

from __future__ import annotations

import math
import time
from typing import Callable

from tqdm import tqdm

__all__ = ["StepBar"]


class StepBar:
    """``total`` steps named ``desc``; :meth:`step` after each one (``loss``: a tensor or a number,
    or None; ``micro_batches``: the forward and backward passes the step took), :meth:`say` for a
    line that must not break the bar, :meth:`close` at the end (or use it as a context manager).
    ``epsilon()``: the ε spent so far (None: no ε shown)."""

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
        self._since = time.monotonic()  # when the steps counted below began
        self._steps = self._micro = 0  # steps and their micro-batches since the text was refreshed

    @property
    def visible(self) -> bool:
        return not self.bar.disable

    def step(self, loss=None, micro_batches: int | None = None) -> None:
        """One step done; ``loss`` the last batch's, ``micro_batches`` the passes it took (shown with
        ε and the seconds per step, throttled as the module says)."""
        self.done += 1
        if not self.visible:
            return
        self.bar.update(1)
        self._steps += 1
        self._micro += micro_batches or 0
        now = time.monotonic()
        last = self.done >= (self.bar.total or 0)
        if now - self._shown < 1.0 and not last:
            return
        self._shown = now
        cost = f"{(now - self._since) / self._steps:.3g} s/step"
        if self._micro > self._steps:  # physical batching split some of these steps
            cost += f" · {self._micro / self._steps:.3g} micro-batches"
        self._since, self._steps, self._micro = now, 0, 0
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
        self.bar.set_postfix_str(", ".join([*(f"{k}={v}" for k, v in shown.items()), cost]), refresh=False)

    def restart_timing(self) -> None:
        """Time the next steps from now (after work that is not a step, e.g. an evaluation)."""
        self._since, self._steps, self._micro = time.monotonic(), 0, 0

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
