"""The item prior of next-item models (dpzoo.seqrec.item_prior): exact weights against a loop over
users, the user-level sensitivity of the released vector, the Gaussian release, its accounting in
train_seqrec (composed into ε, recorded in the saved history, composed again by a later run) and
the "public" variant's statement in the metadata."""

import math

import pytest
import torch

import dpzoo
from dpzoo.errors import InvalidArgumentError
from dpzoo.privacy.accounting.accountant import Accountant
from dpzoo.privacy.budget import prior_spending
from dpzoo.seqrec.item_prior import item_weights, log_prior, private_item_weights, set_output_prior
from dpzoo.seqrec.train import get_dataset, train_seqrec

KW = dict(
    data="synthetic", epochs=1, batch_size=100, max_len=12, eval_every=1, overrides={"d_model": 8}, log=lambda *a: None
)


def _inputs(seed=0, users=30, items=20, t=9):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, items + 1, (users, t), generator=g)
    x[:, :2] = 0  # left padding
    x[0] = 0  # a user with no item
    return x


def _loop_weights(x, items, normalize):
    w = torch.zeros(items + 1, dtype=torch.float64)
    for row in x.tolist():
        held = {i for i in row if i != 0}
        for i in held:
            w[i] += 1.0 / math.sqrt(len(held)) if normalize else 1.0
    return w


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("normalize", [True, False])
def test_weights_equal_a_loop_over_users(seed, normalize):
    x = _inputs(seed)
    got = item_weights(x, 20, normalize=normalize)
    torch.testing.assert_close(got.double(), _loop_weights(x, 20, normalize), rtol=1e-6, atol=1e-6)
    assert got[0] == 0


@pytest.mark.parametrize("seed", range(5))
def test_one_user_moves_the_normalised_weights_by_at_most_one(seed):
    """User-level sensitivity 1: what the Gaussian mechanism's noise multiplier is relative to."""
    x = _inputs(seed, users=25)
    full = item_weights(x, 20)
    moves = [(full - item_weights(torch.cat([x[:u], x[u + 1 :]]), 20)).norm().item() for u in range(len(x))]
    assert max(moves) <= 1 + 1e-5
    assert max(moves) > 1 - 1e-5  # a user with items moves it by exactly 1: the bound is tight
    # without the normalisation the bound fails (why the weights are normalised)
    raw = item_weights(x, 20, normalize=False)
    assert (raw - item_weights(x[2:], 20, normalize=False)).norm() > 1


def test_release_is_exact_weights_plus_gaussian_noise_of_the_multiplier():
    x = _inputs(3)
    got = private_item_weights(x, 20, 4.0, generator=torch.Generator().manual_seed(7))
    noise = 4.0 * torch.randn(21, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    want = item_weights(x, 20) + noise
    want[0] = 0
    torch.testing.assert_close(got, want)
    a = private_item_weights(x, 20, 4.0)
    b = private_item_weights(x, 20, 4.0)
    assert not torch.equal(a, b)  # secret noise by default: two releases differ


@pytest.mark.parametrize("bad", [0, -1.0, True, "5", float("nan")])
def test_release_refuses_a_bad_noise_multiplier(bad):
    with pytest.raises(InvalidArgumentError, match="noise multiplier"):
        private_item_weights(_inputs(), 20, bad)


def test_log_prior_keeps_the_order_and_ranks_padding_last():
    w = torch.tensor([0.0, 5.0, -3.0, 100.0, 0.2, 40.0])
    lp = log_prior(w)
    assert torch.isfinite(lp).all()
    assert lp[3] > lp[5] > lp[1] > lp[2] and lp[2] == lp[4]  # clamped at the floor together
    assert lp[0] < lp[1:].min()
    torch.testing.assert_close(lp[1:].exp().sum(), torch.tensor(1.0))


def test_set_output_prior_refuses_a_model_without_an_output_bias():
    with pytest.raises(InvalidArgumentError, match="no output bias"):
        set_output_prior(torch.nn.Linear(3, 4), torch.zeros(5))


def test_private_prior_is_released_accounted_and_composed_into_epsilon(tmp_path):
    result = train_seqrec(
        "transformer-seqrec", item_prior="private", item_prior_noise=3.0, noise_seed=11, out=tmp_path, **KW
    )
    meta = dpzoo.privacy_metadata(tmp_path / "model")
    assert meta["history"][0] == [3.0, 1.0, 1]  # the release, first
    sigma, q, steps = meta["history"][1]
    assert sigma == pytest.approx(result["noise_multiplier"]) and steps == result["steps"]
    both = Accountant("rdp", meta["history"]).get_epsilon(meta["delta"])
    assert meta["epsilon"] == pytest.approx(both) and both <= 5.0 + 1e-6
    alone = Accountant("rdp", meta["history"][1:]).get_epsilon(meta["delta"])
    assert alone < both - 0.01  # the release is charged, not free
    assert "public_statistics" not in meta
    # a later run on the model composes the whole history, the release included
    loaded = dpzoo.load(tmp_path / "model")
    assert prior_spending(loaded) == meta["history"]


def test_private_prior_starts_the_bias_at_the_released_log_frequencies(monkeypatch):
    seen = {}
    import dpzoo.seqrec.train as train_module

    real = train_module.set_output_prior

    def spy(model, logp):
        seen["logp"] = logp.clone()
        real(model, logp)
        seen["bias"] = model.out.bias.detach().clone()

    monkeypatch.setattr(train_module, "set_output_prior", spy)
    train_seqrec("gru-seqrec", item_prior="private", item_prior_noise=2.0, noise_seed=5, **KW)
    ds = get_dataset("synthetic")
    x, _ = ds.to_padded(12, "train")
    want = log_prior(private_item_weights(x, ds.num_items, 2.0, generator=torch.Generator().manual_seed(6)))
    torch.testing.assert_close(seen["logp"], want)
    torch.testing.assert_close(seen["bias"], want)


def test_public_prior_uses_exact_counts_and_says_so(tmp_path, monkeypatch):
    import dpzoo.seqrec.train as train_module

    seen = {}
    monkeypatch.setattr(train_module, "set_output_prior", lambda m, lp: seen.setdefault("logp", lp))
    train_seqrec("transformer-seqrec", item_prior="public", out=tmp_path, noise_seed=1, **KW)
    ds = get_dataset("synthetic")
    x, _ = ds.to_padded(12, "train")
    torch.testing.assert_close(seen["logp"], log_prior(item_weights(x, ds.num_items)))
    meta = dpzoo.privacy_metadata(tmp_path / "model")
    assert "output bias" in meta["public_statistics"] and "outside ε" in meta["public_statistics"]
    assert len(meta["history"]) == 1  # nothing released inside ε before training


def test_dpformer_metadata_names_its_public_frequencies(tmp_path):
    train_seqrec("dpformer", item_prior="none", out=tmp_path, noise_seed=1, **KW)
    assert "Re-Attention" in dpzoo.privacy_metadata(tmp_path / "model")["public_statistics"]


def test_unknown_item_prior_is_refused():
    with pytest.raises(InvalidArgumentError, match="item_prior must be one of"):
        train_seqrec("gru-seqrec", item_prior="popular", **KW)


def test_each_users_share_never_exceeds_norm_one_even_by_rounding():
    """The sensitivity bound holds in floating point too: removing any one user (long, short,
    repeated items) moves the float64 weights by at most 1 (in float32 it reached 1.00003)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 400, (300, 200), generator=g)
    x[:50, 3:] = 0  # short histories
    x[50:60] = 7  # one item repeated
    full = item_weights(x, 400)
    assert full.dtype == torch.float64
    worst = max(float((full - item_weights(torch.cat([x[:u], x[u + 1 :]]), 400)).norm()) for u in range(0, 300, 7))
    assert 0.99 < worst <= 1.0
