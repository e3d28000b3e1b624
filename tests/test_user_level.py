"""User-level clipping: a user's examples are one privacy unit, their summed gradient is clipped.

Every per-user norm and clipped sum is compared with a brute-force loop in float64: for each
user, one backward pass of the sum of that user's examples' losses."""

from __future__ import annotations

import pytest
import torch
from grad_reference import assert_close, zoo_model_and_inputs

from dpzoo.errors import DPZooError
from dpzoo.grad_norms import attach_norm_hooks
from dpzoo.grad_norms import reps as R
from dpzoo.grad_norms.param_grad import ParamGrad
from dpzoo.grad_norms.units import group_rep, unit_layout

# rows 0..6 belong to users of 1, 2 and 3 examples, not in order
GROUPS = torch.tensor([2, 0, 1, 2, 0, 2, 3])


def per_user_reference(model, loss_fn, inputs: dict, groups: torch.Tensor, scale: torch.Tensor):
    """(per-user total norms, {name: Σ_u scale_u g_u}) by one backward pass per user."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    grads = []
    for u in range(int(groups.max()) + 1):
        rows = (groups == u).nonzero().flatten()
        loss = loss_fn(model, **{k: v[rows] for k, v in inputs.items()})
        got = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        grads.append({n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(params.items(), got)})
    total = torch.stack([torch.sqrt(sum(g.square().sum() for g in gu.values())) for gu in grads])
    clipped = {n: sum(scale[u] * grads[u][n] for u in range(len(grads))) for n in params}
    return total, clipped


def check_per_user(model, inputs, loss_fn, mode, groups=GROUPS, tol=1e-6):
    scale = torch.rand(int(groups.max()) + 1, dtype=torch.float64, generator=torch.Generator().manual_seed(4)) + 0.1
    total, clipped = per_user_reference(model, loss_fn, inputs, groups, scale)
    hooks = attach_norm_hooks(model, mode=mode)
    try:
        hooks.backward(loss_fn(model, **inputs))
        hooks.group_rows(groups)
        assert_close(hooks.per_sample_norms(), total, tol, "per-user norms")
        got = hooks.clipped_sum(scale)
        biggest = max(c.abs().max() for c in clipped.values())
        for n in clipped:
            assert_close(got[n], clipped[n], tol, f"clipped {n}", floor=biggest * 1e-3)
    finally:
        hooks.detach()


def _rows(name, b=7):
    model, inputs, loss_fn = zoo_model_and_inputs(name, b=b)
    return model, inputs, loss_fn


@pytest.mark.parametrize("mode", ["auto", "ghost", "instantiate"])
@pytest.mark.parametrize("name", ["gpt2", "llama-tiny-bias", "resnet18-gn-bias", "dpformer"])
def test_per_user_norms_and_sums_match_a_per_user_loop(name, mode):
    """GPT-2 and DPFormer tie their embeddings (the cross terms of Phantom Clipping per user)."""
    check_per_user(*_rows(name), mode)


@pytest.mark.parametrize("name", ["gpt2", "resnet18-gn-bias"])
def test_per_user_bias_only_norms_match_a_per_user_loop(name):
    model, inputs, loss_fn = _rows(name)
    for n, p in model.named_parameters():
        p.requires_grad_(n.endswith("bias"))
    check_per_user(model, inputs, loss_fn, "auto")


def test_per_user_lora_norms_match_a_per_user_loop():
    from dpzoo.integrations.peft import dp_lora

    model, inputs, loss_fn = _rows("gpt2")
    lora = dp_lora(model, r=4, alpha=8, init_lora_weights=False).double().eval()
    check_per_user(lora, inputs, loss_fn, "auto")


def test_one_user_per_row_is_per_example_clipping():
    model, inputs, loss_fn = _rows("llama-tiny-bias")
    check_per_user(model, inputs, loss_fn, "auto", groups=torch.tensor([3, 1, 0, 2, 6, 5, 4]))


def test_a_user_whose_examples_cancel_has_norm_zero():
    """g_U = g_1 + g_2 with g_2 = −g_1: the unit's norm is 0, not ‖g_1‖ + ‖g_2‖ (on the ghost path
    the float guard's floor, (2⁻⁸ · U)², U = Σ_t ‖L_t‖‖R_t‖ over the user's positions)."""
    left = torch.randn(2, 1, 3, 5, dtype=torch.float64)
    right = torch.randn(2, 1, 3, 4, dtype=torch.float64)
    left[1], right[1] = left[0], -right[0]
    rep = group_rep(R.Factored(left, right, (5, 4)), unit_layout(torch.tensor([0, 0])))
    one = ParamGrad([R.Factored(left[:1], right[:1], (5, 4))], ghost=False).sq_norm().item()
    assert ParamGrad([rep], ghost=False).sq_norm().item() < 1e-25 * one
    u = (left.norm(dim=-1) * right.norm(dim=-1)).sum().item()
    assert ParamGrad([rep], ghost=True).sq_norm().item() <= (1 + 1e-9) * (u / 256) ** 2 < 0.01 * one


@pytest.mark.parametrize(
    "groups, why",
    [
        (torch.tensor([0, 2, 2]), "every id used"),
        (torch.tensor([-1, 0, 0]), "every id used"),
        (torch.tensor([0.0, 1.0, 1.0]), "integer"),
        (torch.tensor([[0, 1, 1]]), "1-D"),
    ],
)
def test_malformed_groups_are_refused(groups, why):
    with pytest.raises(DPZooError, match=why):
        unit_layout(groups)


def test_groups_after_the_norms_are_refused_and_a_wrong_length_too():
    model, inputs, loss_fn = _rows("gpt2", b=3)
    hooks = attach_norm_hooks(model)
    try:
        hooks.backward(loss_fn(model, **inputs))
        hooks.group_rows(torch.tensor([0, 1, 0, 1]))
        with pytest.raises(DPZooError, match="4 rows but the step's gradients have 3"):
            hooks.per_sample_norms()
        hooks.clear()
        hooks.backward(loss_fn(model, **inputs))
        hooks.per_sample_norms()
        with pytest.raises(DPZooError, match="before the first norm"):
            hooks.group_rows(torch.tensor([0, 1, 0]))
    finally:
        hooks.detach()


# -- through make_private: user-level sampling and the DP step -----------------------------------


def _private(model, n=60, users=9, k=3, batch_size=4, sigma=0.0, physical=None, reduction="sum", **kw):
    """make_private at the user level on 60 examples of 9 users (6 or 7 each), k = 3."""
    import warnings

    from torch.utils.data import DataLoader, TensorDataset

    import dpzoo

    gen = torch.Generator().manual_seed(5)
    data = TensorDataset(
        torch.randn(n, 6, generator=gen, dtype=torch.float64), torch.randint(0, 3, (n,), generator=gen)
    )
    ids = kw.pop("user_ids", [f"user-{(i * 7) % users}" for i in range(n)])  # users of 6 or 7 examples
    engine = dpzoo.PrivacyEngine(accountant=kw.pop("accountant_name", "rdp"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # σ = 0 and a fixed sample seed: wanted here
        out = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
            data_loader=DataLoader(data, batch_size=batch_size, collate_fn=kw.pop("collate", None)),
            noise_multiplier=sigma,
            max_grad_norm=0.05,
            loss_reduction=reduction,
            sample_seed=3,
            max_physical_batch_size=physical,
            privacy_unit=kw.pop("privacy_unit", "user"),
            user_ids=ids,
            max_examples_per_user=k,
            **kw,
        )
    return engine, *out


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()


@pytest.mark.parametrize("physical, reduction", [(None, "sum"), (4, "mean"), (3, "sum")])
def test_a_user_level_step_is_the_per_user_clipped_sum(physical, reduction):
    """Each logical step's update, σ = 0, against clipping each user's summed gradient to R by hand;
    micro-batches (max_physical_batch_size) are split between users only."""
    import torch.nn.functional as F

    reference_model = _mlp()
    engine, model, opt, loader = _private(_mlp(), physical=physical, reduction=reduction)
    params = list(reference_model.parameters())
    steps = 0
    expected: list = [torch.zeros_like(p) for p in params]
    for x, y in loader:
        groups = loader.signal.groups
        assert groups is not None and len(groups) == len(x) and len(x) <= (physical or len(x))
        loss = F.cross_entropy(model(x), y, reduction=reduction)
        loss.backward()
        for u in range(int(groups.max()) + 1):
            mine = groups == u
            g = torch.autograd.grad(F.cross_entropy(reference_model(x[mine]), y[mine], reduction="sum"), params)
            norm = torch.sqrt(sum(t.square().sum() for t in g))
            factor = min(1.0, 0.05 / float(norm))
            expected = [e + factor * t for e, t in zip(expected, g)]
        if loader.signal.last_physical:
            opt.step()
            if reduction == "mean":
                expected = [e / engine.expected_batch_size for e in expected]
            for p, e in zip(model.parameters(), expected):
                assert_close(p.grad, e, 1e-6, "user-level update")
            expected = [torch.zeros_like(p) for p in params]
            steps += 1
        else:
            opt.step()
        opt.zero_grad()
    assert steps == engine.steps > 0


def test_user_level_sampling_takes_users_at_rate_q_and_at_most_k_of_their_examples():
    from dpzoo.privacy.users import UserPoissonBatchSampler, user_units

    ids = [i % 5 for i in range(23)] + [7] * 9  # five users of 4-5 examples, one of 9
    units = user_units("user", ids, 3, len(ids), None, "users", None)
    assert units.num_users == 6
    sampler = UserPoissonBatchSampler(units, 0.3, steps=4000, generator=torch.Generator().manual_seed(0))
    seen_users = torch.zeros(6)
    seen_rows = torch.zeros(len(ids))
    for batch in sampler:
        users = [int(units.unit[i]) for i in batch]
        counts = sampler.last_counts
        assert sum(counts) == len(batch) and all(1 <= c <= 3 for c in counts)
        starts = [sum(counts[:j]) for j in range(len(counts))]
        assert len({users[s] for s in starts}) == len(counts)  # one run of rows per user
        for s, c in zip(starts, counts):
            assert len(set(users[s : s + c])) == 1 and len(set(batch[s : s + c])) == c
        for u in {users[s] for s in starts}:
            seen_users[u] += 1
        seen_rows[batch] += 1
    assert torch.allclose(seen_users / 4000, torch.full((6,), 0.3), atol=0.03)
    big = torch.tensor([u == 7 for u in ids])  # its 9 examples are chosen uniformly: q · 3/9 each
    assert torch.allclose(seen_rows[big] / 4000, torch.full((9,), 0.1), atol=0.025)


def test_user_level_metadata_counts_users_and_states_k():
    engine, *_ = _private(_mlp(), sigma=1.0)
    record = engine.privacy_metadata(1e-2)
    assert record["privacy_unit"] == "user" and record["users"] == 9 and record["max_examples_per_user"] == 3
    assert record["sample_rate"] == pytest.approx(4 / 9)
    assert "Poisson over users" in record["sampling"]
    with pytest.raises(DPZooError, match="1/N"):
        engine.get_epsilon(0.2)  # δ ≥ 1/9: N counts users, not the 60 examples


@pytest.mark.parametrize(
    "kw, why",
    [
        ({"user_ids": [0] * 59 + [None]}, "missing for example"),
        ({"user_ids": [0] * 10}, "10 entries for a dataset of 60"),
        ({"k": 0}, "max_examples_per_user must be an integer >= 1"),
        ({"k": 5, "physical": 4}, "exceeds max_physical_batch_size=4"),
        ({"privacy_unit": "person"}, "privacy_unit must be one of"),
    ],
)
def test_user_level_arguments_are_refused_with_the_fix(kw, why):
    with pytest.raises(DPZooError, match=why):
        _private(_mlp(), **kw)


def test_user_ids_without_the_user_unit_are_refused():
    import dpzoo

    with pytest.raises(DPZooError, match="need privacy_unit='user'"):
        dpzoo.PrivacyEngine().make_private(
            module=_mlp(),
            optimizer=torch.optim.SGD(_mlp().parameters(), lr=0.1),
            data_loader=torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 6)), batch_size=2),
            noise_multiplier=1.0,
            user_ids=list(range(8)),
        )


def test_a_batch_memory_manager_below_k_is_refused_and_at_k_splits_between_users():
    import torch.nn.functional as F

    from dpzoo.privacy.batch_memory import BatchMemoryManager

    engine, model, opt, loader = _private(_mlp(), batch_size=6)
    with pytest.raises(DPZooError, match="max_physical_batch_size=2 is below max_examples_per_user=3"):
        BatchMemoryManager(data_loader=loader, max_physical_batch_size=2, optimizer=opt)
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=3, optimizer=opt) as mem:
        for x, y in mem:
            assert len(x) <= 3 and int(loader.signal.groups.max()) + 1 <= 3
            F.cross_entropy(model(x), y, reduction="sum").backward()
            opt.step()
            opt.zero_grad()
    assert engine.steps > 0


# -- example-level sampling with at most k examples per user (ELS): the mixture-of-Gaussians account --


def _mog_reference_epsilon(sigma: float, q: float, k: int, delta: float) -> float:
    """ε at δ of one step, by numerical integration: a user with k examples each sampled at q
    shifts N(0, σ²) by j ~ Binomial(k, q); δ(ε) is the larger hockey-stick divergence of the two
    directions, solved for ε by bisection. Independent of dp-accounting."""
    import math

    from scipy import integrate, optimize, stats

    probs = [math.comb(k, j) * q**j * (1 - q) ** (k - j) for j in range(k + 1)]

    def p(x):
        return sum(pj * stats.norm.pdf(x, j, sigma) for j, pj in enumerate(probs))

    def q0(x):
        return stats.norm.pdf(x, 0, sigma)

    def delta_at(eps):
        lim = (-12 * sigma, k + 12 * sigma)
        one = integrate.quad(lambda x: max(0.0, p(x) - math.exp(eps) * q0(x)), *lim, limit=400)[0]
        two = integrate.quad(lambda x: max(0.0, q0(x) - math.exp(eps) * p(x)), *lim, limit=400)[0]
        return max(one, two)

    return optimize.brentq(lambda e: delta_at(e) - delta, 1e-6, 50.0, xtol=1e-6)


@pytest.mark.parametrize("k, q, sigma", [(3, 0.2, 0.9)])
def test_a_k_example_entry_is_the_mixture_of_gaussians_of_an_independent_integration(k, q, sigma):
    from dpzoo.privacy.accounting.accountant import Accountant

    got = Accountant("pld", [[sigma, q, 1, k]]).get_epsilon(1e-3)
    want = _mog_reference_epsilon(sigma, q, k, 1e-3)
    assert want <= got <= want + 0.02  # PLD's pessimistic discretisation: an upper bound, close


def test_a_k_example_account_lies_between_example_level_and_group_privacy():
    """k = 1 is the Poisson-subsampled Gaussian exactly; for k > 1 the user-level ε is above the
    example-level one and below group privacy's (kε, k·e^((k−1)ε)·δ) bound (Dwork & Roth, Thm 2.2)."""
    import math

    from dpzoo.privacy.accounting.accountant import Accountant

    sigma, q, steps, k, delta = 1.2, 0.02, 50, 3, 1e-6
    example = Accountant("pld", [[sigma, q, steps]]).get_epsilon(delta)
    assert Accountant("pld", [[sigma, q, steps, 1]]).get_epsilon(delta) == example
    user = Accountant("pld", [[sigma, q, steps, k]])
    eps1 = example
    group_delta = k * math.exp((k - 1) * eps1) * delta
    assert example < user.get_epsilon(delta) and user.get_epsilon(group_delta) <= k * eps1


@pytest.mark.parametrize("name", ["rdp", "prv"])
def test_other_accountants_refuse_k_example_entries_naming_pld(name):
    from dpzoo.errors import AccountingError
    from dpzoo.privacy.accounting.accountant import Accountant, get_noise_multiplier

    with pytest.raises(AccountingError, match="use accountant='pld'"):
        Accountant(name, [[1.0, 0.1, 10, 2]])
    with pytest.raises(AccountingError, match="use accountant='pld'"):
        get_noise_multiplier(2.0, 1e-5, 0.1, 10, name, group=2)


def test_noise_for_a_target_covers_the_k_examples_and_entries_merge_by_k():
    from dpzoo.privacy.accounting.accountant import Accountant, get_noise_multiplier

    sigma = get_noise_multiplier(3.0, 1e-5, 0.05, 5, "pld", tolerance=0.05, group=2)
    acc = Accountant("pld", group=2)
    acc.step(sigma, 0.05, 5)
    assert 2.95 <= acc.get_epsilon(1e-5) <= 3.0
    assert sigma > get_noise_multiplier(3.0, 1e-5, 0.05, 5, "pld", tolerance=0.05)  # one example per user: less
    acc.step(sigma, 0.05, 2)
    acc.group = 1
    acc.step(sigma, 0.05, 2)
    assert acc.history == [[sigma, 0.05, 7, 2], [sigma, 0.05, 2]]


def test_example_level_sampling_keeps_k_examples_per_user_and_records_the_mixture():
    import torch.nn.functional as F

    engine, model, opt, loader = _private(
        _mlp(), sigma=1.0, user_sampling="examples", accountant_name="pld", batch_size=6, physical=None
    )
    ids = [f"user-{(i * 7) % 9}" for i in range(60)]
    seen: dict = {}
    for _ in range(1):
        for x, y in loader:
            assert loader.signal.groups is None  # clipped example by example
            F.cross_entropy(model(x), y, reduction="sum").backward()
            opt.step()
            opt.zero_grad()
    kept = loader.batch_sampler.indices.tolist()
    for i in kept:
        seen.setdefault(ids[i], set()).add(i)
    assert len(kept) == 27 and all(len(v) == 3 for v in seen.values())  # 9 users, k = 3 each
    record = engine.privacy_metadata(1e-3)
    assert record["history"] == [[1.0, 6 / 27, engine.steps, 3]] and record["accountant"] == "pld"
    assert record["sampling"].startswith("Poisson over examples, at most k per user")
    assert record["epsilon"] > dpzoo_epsilon_one_per_user(engine.steps)


def dpzoo_epsilon_one_per_user(steps):
    from dpzoo.privacy.accounting.accountant import Accountant

    return Accountant("pld", [[1.0, 6 / 27, steps]]).get_epsilon(1e-3)


def test_example_level_sampling_with_an_accountant_that_cannot_account_it_is_refused():
    with pytest.raises(DPZooError, match="use accountant='pld'"):
        _private(_mlp(), sigma=1.0, user_sampling="examples")


@pytest.mark.parametrize("sampling", ["users", "examples"])
def test_a_user_level_model_saves_a_card_that_states_the_unit_and_loads_back(tmp_path, sampling):
    """The card validates against the schema, says "user", the number of users and k, and its ε
    recomputes from the history (the [σ, q, steps, k] entries of example-level sampling too)."""
    import json
    import warnings
    from pathlib import Path

    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    import dpzoo
    from dpzoo.hub.privacy_card import read_card

    jsonschema = pytest.importorskip("jsonschema")
    torch.manual_seed(0)
    model = dpzoo.load("mlp-tanh", in_features=4, num_classes=2, width=8)
    data = TensorDataset(torch.randn(40, 4), torch.randint(0, 2, (40,)))
    engine = dpzoo.PrivacyEngine(accountant="pld")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(data, batch_size=3), noise_multiplier=1.5, max_grad_norm=1.0,
            privacy_unit="user", user_ids=[i % 8 for i in range(40)], max_examples_per_user=2, user_sampling=sampling,
        )  # fmt: skip
        for x, y in loader:
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    directory = dpzoo.save(model, tmp_path / "model", privacy=engine.privacy_metadata(1e-2))
    front = read_card(directory)
    jsonschema.validate(
        front, json.loads((Path(__file__).parents[1] / "docs" / "privacy_card.schema.json").read_text())
    )
    block = front["privacy"]
    assert block["unit_of_privacy"] == "user" and block["users"] == 8 and block["max_examples_per_user"] == 2
    assert (len(block["history"][0]) == 4) == (sampling == "examples")
    assert "one user" in dpzoo.privacy_statement(directory)
    assert dpzoo.load(directory).dpzoo_privacy["epsilon"] == pytest.approx(engine.get_epsilon(1e-2))


def test_one_example_per_user_is_example_level_dp_bit_for_bit():
    """DPFormer's user-level DP (one sequence per user) now goes through privacy_unit="user" with
    k = 1: the same Poisson draws, the same clipping, the same noise, so the same parameters."""
    import warnings

    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    import dpzoo

    def run(**user):
        model, inputs, loss_fn = zoo_model_and_inputs("dpformer", b=12)
        model = model.float().train()
        engine = dpzoo.PrivacyEngine()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, opt, loader = engine.make_private(
                module=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
                data_loader=DataLoader(TensorDataset(inputs["ids"]), batch_size=6), noise_multiplier=1.0,
                max_grad_norm=0.5, noise_seed=1, sample_seed=2, max_physical_batch_size=4, loss_reduction="sum", **user,
            )  # fmt: skip
        for (ids,) in loader:
            logits = model(ids)[:, :-1]
            F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), ignore_index=0, reduction="sum").backward()
            opt.step()
            opt.zero_grad()
        return [p.detach() for p in model.parameters()], engine

    example, e1 = run()
    user, e2 = run(privacy_unit="user", user_ids=range(12), max_examples_per_user=1)
    assert all(torch.equal(a, b) for a, b in zip(example, user)) and e1.steps == e2.steps > 0
    assert e2.privacy_metadata(1e-3)["privacy_unit"] == "user" and e1.get_epsilon(1e-3) == e2.get_epsilon(1e-3)


# -- found by the adversarial review of user-level DP --------------------------------------------


def _sorting_collate(samples):
    from torch.utils.data.dataloader import default_collate

    return default_collate(sorted(samples, key=lambda s: int(s[1])))  # by label, as packing collates sort


def _reversing_collate(samples):
    from torch.utils.data.dataloader import default_collate

    return default_collate(samples[::-1])


@pytest.mark.parametrize("collate", [_sorting_collate, _reversing_collate])
def test_a_collate_that_reorders_rows_is_refused_at_the_user_level(collate):
    """Users are positional in the batch: a reordering collate put rows of several users into one
    clipped unit (2.07 R with σ = 0, silent)."""
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    import dpzoo

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(24, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (24,), generator=g))
    model = _mlp()
    engine = dpzoo.PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=DataLoader(data, batch_size=6, collate_fn=collate), noise_multiplier=1.0,
        privacy_unit="user", user_ids=[i % 6 for i in range(24)], max_examples_per_user=4,
    )  # fmt: skip
    with pytest.raises(DPZooError, match="must keep the samples' order"):
        for x, y in loader:
            F.cross_entropy(model(x), y).backward()
            opt.step()


def test_an_order_keeping_custom_collate_trains():
    from torch.utils.data.dataloader import default_collate

    def keeps(samples):
        return default_collate([(x * 2, y) for x, y in samples])

    engine, model, opt, loader = _private(_mlp(), sigma=1.0, collate=keeps)
    for x, y in loader:
        torch.nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
        opt.step()
    assert engine.steps > 0


def test_a_batch_memory_manager_below_k_is_refused_when_made_not_when_a_big_user_is_drawn():
    from dpzoo.privacy.batch_memory import BatchMemoryManager

    engine, model, opt, loader = _private(_mlp(), sigma=1.0, k=5)
    with pytest.raises(DPZooError, match="max_physical_batch_size=4 is below max_examples_per_user=5"):
        BatchMemoryManager(data_loader=loader, max_physical_batch_size=4, optimizer=opt)


@pytest.mark.parametrize(
    "ids, why",
    [
        (lambda: [0] * 59 + [__import__("numpy").float32("nan")], "missing for example"),
        (lambda: [0] * 59 + [__import__("decimal").Decimal("NaN")], "missing for example"),
        (lambda: torch.zeros(60, 2, dtype=torch.long), "1-D"),
        (lambda: [[0]] * 60, "hashable"),
    ],
)
def test_more_malformed_user_ids_are_refused(ids, why):
    with pytest.raises(DPZooError, match=why):
        _private(_mlp(), user_ids=ids())


def test_a_batch_above_the_users_says_users():
    with pytest.raises(DPZooError, match="exceeds the dataset's 9 users"):
        _private(_mlp(), batch_size=10)


def test_dp_lora_at_the_user_level_through_make_private():
    """mode="lora" on a PEFT GPT-2 with privacy_unit="user", σ = 0, q = 1: the adapters' released
    gradient is each user's summed gradient clipped to R, summed (brute force per user)."""
    import warnings

    from torch.utils.data import DataLoader, TensorDataset

    import dpzoo
    from dpzoo.integrations.peft import dp_lora

    model, inputs, loss_fn = zoo_model_and_inputs("gpt2", b=7)
    lora = dp_lora(model, r=4, alpha=8, init_lora_weights=False).double().eval()
    ids = inputs["ids"]
    users = GROUPS.tolist()  # 4 users of 1-3 sequences
    trainable = {n: p for n, p in lora.named_parameters() if p.requires_grad}
    r = 0.05
    scale = torch.ones(4, dtype=torch.float64)
    norms, _ = per_user_reference(lora, loss_fn, {"ids": ids}, GROUPS, scale)
    clip = {u: min(1.0, r / float(norms[u])) for u in range(4)}
    _, want = per_user_reference(lora, loss_fn, {"ids": ids}, GROUPS, torch.tensor([clip[u] for u in range(4)]))
    engine = dpzoo.PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        private, opt, loader = engine.make_private(
            module=lora, optimizer=torch.optim.SGD(trainable.values(), lr=0.0),
            data_loader=DataLoader(TensorDataset(ids), batch_size=4), noise_multiplier=0.0, max_grad_norm=r,
            loss_reduction="sum", mode="lora", sample_seed=0, privacy_unit="user", user_ids=users,
            max_examples_per_user=3,
        )  # fmt: skip
    (batch,) = next(iter(loader))
    order = sorted(range(7), key=lambda i: [int(t) for t in ids[i]])
    assert len(batch) == 7 and sorted([int(t) for t in b] for b in batch) == [[int(t) for t in ids[i]] for i in order]
    groups = loader.signal.groups
    loss_fn(private, ids=batch).backward()
    opt.step()
    rows = {tuple(int(t) for t in ids[i]): i for i in range(7)}
    batch_users = torch.tensor([users[rows[tuple(int(t) for t in b)]] for b in batch])
    names = [n for n, p in private.named_parameters() if p.requires_grad]
    assert all((batch_users[groups == g] == batch_users[groups == g][0]).all() for g in groups.unique())
    for n in names:
        p = dict(private.named_parameters())[n]
        assert_close(p.grad, want[n], 1e-6, n, floor=max(w.abs().max() for w in want.values()) * 1e-3)
