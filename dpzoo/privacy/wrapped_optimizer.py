"""A :class:`torch.optim.Optimizer` that stands in for another: it shares the wrapped
optimizer's ``param_groups``, ``state`` and ``defaults``, so ``torch.optim.lr_scheduler`` and
parameter-group edits act on the one optimizer underneath (as Opacus' ``DPOptimizer`` does).

:class:`~dpzoo.privacy.optimizer.DPOptimizer` builds its private step on this.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

__all__ = ["WrappedOptimizer"]


class WrappedOptimizer(torch.optim.Optimizer):
    """Delegates ``param_groups``, ``state``, ``defaults``, ``add_param_group`` and ``zero_grad``
    to ``optimizer`` (kept as :attr:`original_optimizer`); ``step`` is the subclass's."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        # No Optimizer.__init__: param_groups and state are the wrapped optimizer's (properties below).
        self.original_optimizer = optimizer
        self._optimizer_step_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict = OrderedDict()

    @property
    def param_groups(self):
        return self.original_optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.original_optimizer.param_groups = value

    @property
    def state(self):
        return self.original_optimizer.state

    @state.setter
    def state(self, value):
        self.original_optimizer.state = value

    @property
    def defaults(self):
        return self.original_optimizer.defaults

    @defaults.setter
    def defaults(self, value):
        self.original_optimizer.defaults = value

    def add_param_group(self, param_group: dict) -> None:
        self.original_optimizer.add_param_group(param_group)  # a subclass checks the result at step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.original_optimizer.zero_grad(set_to_none=set_to_none)
