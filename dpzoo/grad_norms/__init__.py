"""Standardized per-sample gradient norms on every layer (see :func:`attach_norm_hooks`)."""

from .hooks import MODES, NormHooks, attach_norm_hooks
from .registry import RULES, Rule, find_rule, register_rule
from .reps import Dense, Factored, OneHot

__all__ = ["attach_norm_hooks", "NormHooks", "MODES", "register_rule", "find_rule", "Rule", "RULES",
           "Dense", "Factored", "OneHot"]
