"""Standardized per-sample gradient norms on every layer (see :func:`attach_norm_hooks`)."""

from . import rules  # noqa: F401  (registers the built-in rules: importing any grad_norms module runs this)
from .hooks import LOOSE_TENSORS, MODES, NormHooks, attach_norm_hooks, attached_norm_hooks, register_loose_tensors
from .plan import Problem, find_problems
from .registry import RULES, Rule, find_rule, register_rule
from .reps import Dense, Factored, OneHot

__all__ = [
    "register_loose_tensors",
    "LOOSE_TENSORS",
    "attach_norm_hooks",
    "attached_norm_hooks",
    "NormHooks",
    "find_problems",
    "Problem",
    "MODES",
    "register_rule",
    "find_rule",
    "Rule",
    "RULES",
    "Dense",
    "Factored",
    "OneHot",
]
