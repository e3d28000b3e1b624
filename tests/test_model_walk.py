"""dpzoo.privacy.model_walk lists exactly what torch's walks list, in the same order, on models with
shared modules, tied and missing parameters, buffers, nesting, and a class that overrides a walk."""

from __future__ import annotations

import pytest
import timm
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from dpzoo.privacy import model_walk


class _Shared(nn.Module):
    """A submodule registered twice, a parameter tied across modules, a None child, parameter and buffer."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(3, 3)
        self.a = nn.Sequential(nn.Linear(3, 4), self.shared, nn.BatchNorm1d(3))
        self.b = nn.ModuleDict({"again": self.shared, "empty": nn.Identity()})
        self.tied = nn.Linear(3, 3)
        self.tied.weight = self.shared.weight
        self.nothing = None
        self.register_parameter("missing", None)
        self.register_buffer("table", torch.arange(4.0))
        self.register_buffer("absent", None)
        self.register_buffer("scratch", torch.zeros(2), persistent=False)


class _WalkedWithASideEffect(nn.Linear):
    walked = 0

    def named_modules(self, *args, **kwargs):
        type(self).walked += 1
        return super().named_modules(*args, **kwargs)


class _DeepFirst(nn.Module):
    """A module shared at two depths, first reached by the deeper path (depth first), and one
    buffer tensor registered in two modules."""

    def __init__(self):
        super().__init__()
        inner = nn.Linear(2, 2)
        table = torch.ones(3)
        self.deep = nn.Sequential(nn.Sequential(inner))
        self.shallow = inner
        self.deep[0].register_buffer("table", table)
        self.register_buffer("same_table", table)


def _gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=8))


MODELS = {
    "shared": _Shared,
    "deep-first": _DeepFirst,
    "gpt2-tied": _gpt2,
    "resnet": lambda: timm.create_model("resnet18", num_classes=3),
    "nested": lambda: nn.Sequential(nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.GroupNorm(1, 2))), nn.Linear(2, 1)),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_the_flat_walk_lists_what_torch_lists_in_the_same_order(name):
    model = MODELS[name]()
    assert [(n, id(m)) for n, m in model_walk.named_modules(model)] == [(n, id(m)) for n, m in model.named_modules()]
    assert [id(p) for p in model_walk.parameters(model)] == [id(p) for p in model.parameters()]
    ours, theirs = model_walk.named_buffers(model), dict(model.named_buffers())
    assert list(ours) == list(theirs) and all(ours[k] is theirs[k] for k in theirs)


def test_a_shared_module_and_a_tied_parameter_are_listed_once():
    model = _Shared()
    names = [n for n, _ in model_walk.named_modules(model)]
    assert "shared" in names and "a.1" not in names and "b.again" not in names  # named where first reached
    assert len(model_walk.parameters(model)) == len({id(p) for p in model.parameters()})
    assert set(model_walk.named_buffers(model)) >= {"table", "scratch", "a.2.running_mean"}


def test_a_class_that_overrides_a_walk_is_walked_by_torch():
    model = nn.Sequential(nn.Linear(2, 2), _WalkedWithASideEffect(2, 2))
    before = _WalkedWithASideEffect.walked
    assert model_walk.named_modules(model) is None  # the caller must use torch's walk
    assert [id(p) for p in model_walk.parameters(model)] == [id(p) for p in model.parameters()]
    assert _WalkedWithASideEffect.walked > before  # torch's walk ran, with the class's own side effect
    assert list(model_walk.named_buffers(model)) == [n for n, _ in model.named_buffers()]


def _drops_its_parameters(self, *args, **kwargs):
    return iter(())


@pytest.mark.parametrize("walk", model_walk.WALKS)
def test_any_override_of_a_walk_or_of_how_modules_compare_falls_back_to_torch(walk):
    hide = _drops_its_parameters if not walk.startswith("__") else (lambda self, *a: 0 if walk == "__hash__" else True)
    overriding = type("Overriding", (nn.Linear,), {walk: hide})
    model = nn.Sequential(nn.Linear(2, 2), overriding(2, 2))
    assert model_walk.named_modules(model) is None
    on_instance = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    setattr(on_instance[1], walk, hide.__get__(on_instance[1]))
    assert model_walk.named_modules(on_instance) is None  # an override on the instance too


def test_a_patched_torch_walk_or_a_value_compared_parameter_falls_back_to_torch(monkeypatch):
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    monkeypatch.setattr(nn.Module, "parameters", lambda self, recurse=True: iter([]))
    assert model_walk.parameters(model) == []  # torch's (patched) walk, not the flat one
    monkeypatch.undo()

    class Valued(nn.Parameter):
        def __hash__(self):
            return 0

        def __eq__(self, other):
            return True

    model[1].weight = Valued(torch.ones(2, 2))
    model[0].weight = Valued(torch.ones(2, 2))
    assert [id(p) for p in model_walk.parameters(model)] == [id(p) for p in model.parameters()]


def test_a_training_step_walks_the_model_three_times_and_still_sees_a_new_buffer(monkeypatch):
    """The guards' walks of an engine step: one before the forward (trainable set and buffers
    together), one after it, one at the step; a buffer a forward registers is still refused."""
    from torch.utils.data import DataLoader, TensorDataset

    import dpzoo
    from dpzoo.errors import PrivacyUsageError
    from dpzoo.privacy import watch

    walks = []
    real = model_walk.named_modules

    def counted(module):
        walks.append(1)
        return real(module)

    monkeypatch.setattr(model_walk, "named_modules", counted)
    monkeypatch.setattr(watch, "named_modules", counted)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 3, (64,)))
    model, opt, loader = dpzoo.PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(data, batch_size=16),
        noise_multiplier=1.0, max_grad_norm=1.0, self_check=False,
    )  # fmt: skip
    batches = iter(loader)
    for step in range(2):
        x, y = next(batches)
        walks.clear()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        assert len(walks) == 3, (step, len(walks))
    model[0].register_buffer("seen", torch.zeros(1))  # registered between steps: a new buffer at the next forward
    x, y = next(batches)
    model[0].register_forward_hook(lambda m, a, out: m.seen.add_(1) and None)  # a statistic of the batch's call
    with pytest.raises(PrivacyUsageError, match="seen"):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
