"""A DP-trained checkpoint loaded by name (``dpzoo.load(name, weights=...)``, the route dpzoo's own
error message points to) keeps its privacy record, so training it again composes the earlier
spending instead of reporting only the new run's ε. Found by an independent review: the record was
dropped, and a second ε = 5 run on the same data reported ε 5.0 for a total near 10."""

from __future__ import annotations

import shutil

import pytest
from safetensors.torch import save_model

import dpzoo
from dpzoo.errors import AccountingError, CheckpointError
from dpzoo.privacy.budget import prior_spending
from dpzoo.seqrec.train import train_seqrec

KW = dict(data="synthetic", epochs=1, batch_size=100, max_len=12, eval_every=1, log=lambda *a: None)
SIZE = {"d_model": 8}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("first")
    train_seqrec("gru-seqrec", out=out, overrides=dict(SIZE), noise_seed=3, **KW)
    return out / "model", dpzoo.privacy_metadata(out / "model")


def _by_name(weights, num_items):
    return dpzoo.load("gru-seqrec", weights=weights, num_items=num_items, max_len=12, **SIZE)


def test_weights_from_a_saved_directory_or_its_file_keep_the_record(trained, tmp_path):
    directory, meta = trained
    items = dpzoo.load(directory).dpzoo_config["overrides"]["num_items"]
    assert len(meta["history"]) == 2  # the item prior's release and the DP-SGD steps
    model = _by_name(directory / "model.safetensors", items)
    assert model.dpzoo_privacy == meta
    assert prior_spending(model) == meta["history"]
    # the file copied on its own: read back from its safetensors header
    alone = tmp_path / "copied.safetensors"
    shutil.copy(directory / "model.safetensors", alone)
    assert _by_name(alone, items).dpzoo_privacy["history"] == meta["history"]


def test_training_from_those_weights_again_composes_the_earlier_spending(trained, tmp_path):
    directory, meta = trained
    weights = str(directory / "model.safetensors")
    with pytest.raises(AccountingError, match="already spends"):  # the same target: nothing left to spend
        train_seqrec("gru-seqrec", overrides={**SIZE, "weights": weights}, epsilon=meta["epsilon"], **KW)
    result = train_seqrec(
        "gru-seqrec", out=tmp_path / "second", overrides={**SIZE, "weights": weights}, epsilon=2 * meta["epsilon"], **KW
    )
    history = dpzoo.privacy_metadata(tmp_path / "second" / "model")["history"]
    assert history[: len(meta["history"])] == meta["history"] and len(history) == len(meta["history"]) + 2
    assert result["epsilon"] == pytest.approx(2 * meta["epsilon"], rel=1e-2)


def test_an_unreadable_record_in_a_header_is_refused_not_dropped(trained, tmp_path):
    directory, _ = trained
    model = dpzoo.load(directory)
    broken = tmp_path / "broken.safetensors"
    save_model(model, str(broken), metadata={"format": "pt", "dpzoo.privacy.epsilon": "about five"})
    with pytest.raises(CheckpointError, match="privacy record"):
        _by_name(broken, model.dpzoo_config["overrides"]["num_items"])
    plain = tmp_path / "plain.safetensors"
    save_model(model, str(plain), metadata={"format": "pt"})
    assert getattr(_by_name(plain, model.dpzoo_config["overrides"]["num_items"]), "dpzoo_privacy", None) is None
