"""Assembly: a step's records turned into one :class:`~dpzoo.grad_norms.param_grad.ParamGrad` per
trainable parameter.

Each recorded use goes through its layer's rule (activation, output gradient →
representation, :mod:`dpzoo.grad_norms.rules`), or is a loose tensor's per-sample gradient
itself; the shapes and batch sizes are checked, and parameters no gradient reached get zeros.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..errors import UnsupportedModuleError
from . import reps as R
from .audit import check_versions
from .capture import Step
from .cost import plan_uses
from .param_grad import ParamGrad
from .plan import ModelPlan
from .sharded import planned
from .units import group_rep

__all__ = ["assemble", "rep_shape", "common_dtype", "rule_operands"]


def rep_shape(rep) -> tuple:
    return tuple(rep.grad.shape[1:]) if isinstance(rep, R.Dense) else tuple(rep.shape)


def common_dtype(activations, grad):
    """``(activations, grad)`` in one floating dtype. Under autocast a layer's input and its output
    gradient differ (float32 and bfloat16 / float16), and half-precision sums lose the small
    per-sample terms, so the per-sample representations are formed in float32 whenever a half
    dtype or two dtypes meet (float64 if one is float64); the clipped sum is cast back to the
    parameter's dtype. One full-precision dtype is left as it is."""
    tensors = [t for t in (*(activations or ()), grad) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    found = {t.dtype for t in tensors}
    if len(found) <= 1 and not found & {torch.float16, torch.bfloat16}:
        return activations, grad
    target = torch.float64 if torch.float64 in found else torch.float32

    def cast(t):
        return t.to(target) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    return (None if activations is None else tuple(cast(a) for a in activations)), cast(grad)


def rule_operands(rule, activations, grad):
    """What ``rule`` gets: for a rule with ``half_factors`` whose layer's output gradient is half,
    the inputs in that half dtype (a float32 input beside a half output means the layer computed
    on its input cast to half, as autocast does: that cast is the gradient's true factor), the
    norms and sums then formed exactly from them (:mod:`.half`); else :func:`common_dtype`."""
    if not activations:  # an activation-free use (a bias): its gradient alone, half values in float32 unless kept
        keep = rule.half_factors or grad.dtype not in (torch.float16, torch.bfloat16)
        return activations, grad if keep else grad.float()
    floats = [a for a in activations or () if isinstance(a, torch.Tensor) and a.is_floating_point()]
    half = grad.dtype in (torch.float16, torch.bfloat16)
    if rule.half_factors and half and all(a.dtype in (grad.dtype, torch.float32) for a in floats):
        if activations is not None:
            activations = tuple(
                a.to(grad.dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in activations
            )
        return activations, grad
    return common_dtype(activations, grad)


def assemble(
    step: Step, plan: ModelPlan, ghost: bool | None, memory_budget: float | None = None, autotune: bool | None = None
) -> dict[str, ParamGrad]:
    """{parameter name: its per-sample gradients} from the records of ``step`` (audited before:
    :func:`dpzoo.grad_norms.audit.check_step`). Sets ``step.unreached`` and ``step.costs`` (the
    planner's choice per use, :mod:`dpzoo.grad_norms.cost`, when ``ghost`` is None: ghost norm or
    instantiation by time within ``memory_budget`` bytes, timed when ``autotune``, None: on CUDA); drops the activations."""
    if step.batch_size == 0:  # an empty batch (under FSDP2 every rank runs one): no sample, no rule to run
        step.unreached = []
        empty = {n: [R.Dense(torch.zeros(0, *p.shape, dtype=p.dtype, device=p.device))] for n, p in plan.params.items()}
        step.costs = plan_uses(empty, 0.0)
        return {n: ParamGrad(rs, ghost) for n, rs in empty.items()}
    by_param: dict[str, list] = {n: [] for n in plan.params}
    sizes = set()
    for use in step.uses:
        if use.grad is None:
            continue  # output did not reach the loss
        if use.loose:
            n = use.params[0]
            name = plan.param_names[id(planned(step.aliases, use.module._parameters[n]))]
            by_param[name].append(R.Dense(common_dtype((), use.grad)[1].unsqueeze(1)))
            sizes.add((use.module_name, use.grad.shape[0]))
            continue
        rule = plan.rules[id(use.module)]
        if use.versions is not None:  # a use with stored inputs
            check_versions(use)
        activations, grad = rule_operands(rule, use.activations, use.grad)
        try:
            out = rule.fn(use.module, activations, grad, set(use.params))
        except RuntimeError as e:  # a rule that does not fit what the layer computed: refuse, naming it
            raise UnsupportedModuleError(
                f"The per-sample rule for {use.module_name} ({type(use.module).__name__}) failed on what the layer "
                f"recorded ({str(e).splitlines()[0][:160]}): the module does not compute what its rule assumes."
            ) from e
        use.activations = None  # the representations hold what is needed from here on
        for local, rep in out.items():
            p = getattr(use.module, local)
            if step.aliases:  # FSDP2: the sharded parameter
                p = planned(step.aliases, p)
            if tuple(rep_shape(rep)) != tuple(p.shape):
                raise UnsupportedModuleError(
                    f"The rule for {use.module_name} ({type(use.module).__name__}) produced a per-sample "
                    f"gradient of shape {tuple(rep_shape(rep))} for {local}, whose shape is {tuple(p.shape)}: "
                    "the module does not compute what its rule assumes."
                )
            by_param[plan.param_names[id(p)]].append(rep)
            sizes.add((use.module_name, rep.batch_size))
    batch = {b for _, b in sizes}
    if step.batch_size is not None:
        batch.add(step.batch_size)
    if len(batch) > 1:
        detail = ", ".join(sorted(f"{n or '<root>'}: {b}" for n, b in sizes))
        raise UnsupportedModuleError(
            f"Layers saw different batch sizes in one step (batch {step.batch_size}; {detail}), so "
            "per-sample gradients cannot be matched across them. Every hooked layer must take "
            "batch-first inputs."
        )
    step.unreached = [n for n, rs in by_param.items() if not rs]
    for n in step.unreached:  # unused in this step: zero gradient
        p = plan.params[n]
        b = next(iter(batch)) if batch else 0
        by_param[n] = [R.Dense(torch.zeros(b, *p.shape, dtype=p.dtype, device=p.device))]
    if step.groups is not None:  # privacy units of several rows: each unit's gradient, before any plan
        by_param = {n: [group_rep(r, step.groups) for r in rs] for n, rs in by_param.items()}
    if ghost is not None:  # forced: every use on one path
        step.costs = {
            n: [replace(c, ghost=ghost, freed=False, why="forced") for c in cs]
            for n, cs in plan_uses(by_param, 0.0).items()
        }
        return {n: ParamGrad(rs, ghost) for n, rs in by_param.items()}
    step.costs = plan_uses(by_param, memory_budget, autotune)
    out = {}
    for n, rs in by_param.items():  # one loop, no comprehension per parameter: this runs every step
        choices, freed = [], False
        for c in step.costs[n]:
            choices.append(c.ghost)
            freed = freed or c.freed
        out[n] = ParamGrad(rs, None, choices, freed=freed)
    return out
