"""The ε = 5 next-item recipe (issue 17, docs/RESULTS.md) on synthetic data: its pieces are the
defaults of train_seqrec and `dpzoo train` (private item prior, no dropout, B 1024 or a quarter of
the users, Adam lr 1e-2, 20 epochs), and what it trains is private: per-sample norms of the
recipe's model (prior in the bias, no dropout, tied embedding) exact against a loop of per-sample
backward passes, ε from the accountant over the prior's release and every step."""

import inspect

import pytest
import torch
import torch.nn.functional as F
from grad_reference import check_against_brute_force

import dpzoo
from dpzoo.cli import main
from dpzoo.privacy.accounting.accountant import Accountant
from dpzoo.seqrec.item_prior import item_weights, log_prior, set_output_prior
from dpzoo.seqrec.train import RECIPE_OVERRIDES, get_dataset, train_seqrec


def test_train_seqrec_defaults_are_the_recipe():
    sig = inspect.signature(train_seqrec).parameters
    assert sig["item_prior"].default == "private" and sig["item_prior_noise"].default == 5.0
    assert sig["epochs"].default == 20 and sig["lr"].default == 1e-2 and sig["batch_size"].default is None
    assert RECIPE_OVERRIDES == {"dropout": 0.0}


def test_cli_sequence_defaults_reach_train_seqrec(monkeypatch):
    import dpzoo.runs.classifier as image_train
    import dpzoo.seqrec.train as seqrec_train

    seen = {}

    def stub(*args, **kwargs):
        seen.update(kwargs)
        return {"model": "m", "steps": 0, "epsilon": None, "history": []}

    monkeypatch.setattr(seqrec_train, "train_seqrec", stub)
    monkeypatch.setattr(image_train, "train_image_classifier", stub)
    assert main(["train", "transformer-seqrec", "--quiet"]) == 0
    assert seen["epochs"] == 20 and seen["lr"] == 1e-2 and seen["batch_size"] is None
    assert "item_prior" not in seen  # train_seqrec's default, "private", applies
    seen.clear()
    assert main(["train", "resnet18-gn-bias", "--quiet"]) == 0
    assert (seen["epochs"], seen["batch_size"], seen["lr"]) == (10, 64, 2e-3)  # images keep theirs
    seen.clear()
    assert main(["train", "gru-seqrec", "--quiet", "--item-prior", "public", "--lr", "3e-3"]) == 0
    assert seen["item_prior"] == "public" and seen["lr"] == 3e-3


def test_recipe_run_uses_no_dropout_unless_overridden(tmp_path):
    kw = dict(data="synthetic", epochs=1, max_len=10, overrides={"d_model": 8}, eval_every=1, log=lambda *a: None)
    result = train_seqrec("transformer-seqrec", out=tmp_path / "a", noise_seed=0, **kw)
    assert result["model_overrides"]["dropout"] == 0.0
    assert dpzoo.read_config(tmp_path / "a" / "model")["overrides"]["dropout"] == 0.0
    assert result["batch_size"] == len(get_dataset("synthetic").to_padded(10, "train")[0]) // 4
    kw["overrides"] = {"d_model": 8, "dropout": 0.2}
    result = train_seqrec("transformer-seqrec", noise_seed=0, **kw)
    assert result["model_overrides"]["dropout"] == 0.2  # the user's override wins


def test_recipe_epsilon_is_the_accountants_over_release_and_steps(tmp_path):
    result = train_seqrec(
        "transformer-seqrec",
        data="synthetic",
        epsilon=3.0,
        epochs=2,
        max_len=10,
        overrides={"d_model": 8},
        eval_every=2,
        log=lambda *a: None,
        out=tmp_path,
    )
    meta = dpzoo.privacy_metadata(tmp_path / "model")
    history = meta["history"]
    assert history[0] == [5.0, 1.0, 1] and history[1][1] == pytest.approx(result["sample_rate"])
    assert history[1][2] == result["steps"] > 0
    assert result["epsilon"] == pytest.approx(Accountant("rdp", history).get_epsilon(meta["delta"]), rel=1e-9)
    assert 2.5 < result["epsilon"] <= 3.0 + 1e-6  # calibrated to the target over the release and the steps
    assert meta["noise"].startswith("secret") and meta["privacy_unit"] == "user"


@pytest.mark.parametrize("mode", ["auto", "ghost", "instantiate"])
@pytest.mark.parametrize("name", ["transformer-seqrec", "dpformer", "gru-seqrec"])
def test_per_sample_norms_of_the_recipe_model_are_exact(name, mode):
    """The recipe's model as trained (no dropout, the prior in the output bias, tied embedding),
    in train mode, against a loop of per-sample backward passes."""
    torch.manual_seed(0)
    card = dpzoo.model_card(name)
    over = {**card.test_overrides, **RECIPE_OVERRIDES}
    model = dpzoo.load(name, **over).double().train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, over["num_items"] + 1, (5, over["max_len"]), generator=g)
    ids[0, :3] = 0  # left padding
    set_output_prior(model, log_prior(item_weights(ids, over["num_items"])).double())
    if hasattr(model, "set_token_frequencies"):
        model.set_token_frequencies(ids)
        model.set_dp_noise(noise_multiplier=1.5, max_grad_norm=1.0, expected_batch_size=5)

    def loss_fn(m, ids):
        logits = m(ids)[:, :-1]
        return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum", ignore_index=0)

    check_against_brute_force(model, {"ids": ids}, loss_fn, mode)
