"""DPFormer (issue 5): Re-Attention wired into the tied sequential Transformer."""

from __future__ import annotations

import math

import pytest
import torch
from grad_reference import check_against_brute_force, zoo_model_and_inputs
from seqrec_reference import reattention as reference_reattention
from torch.utils.data import DataLoader, TensorDataset

import dpzoo
from dpzoo.errors import InvalidArgumentError
from dpzoo.seqrec import reattention as ep

SMALL = {"num_items": 30, "max_len": 8, "d_model": 16, "num_blocks": 2, "dropout": 0.0}


def _pair(seed=0):
    torch.manual_seed(seed)
    vanilla = dpzoo.load("transformer-seqrec", **SMALL).double().eval()
    dpformer = dpzoo.load("dpformer", **SMALL).double().eval()
    dpformer.load_state_dict(vanilla.state_dict(), strict=False)
    return vanilla, dpformer


def _ids(b=4, t=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, SMALL["num_items"] + 1, (b, t), generator=g)
    ids[0, :3] = 0  # left padding
    return ids


def test_no_trainable_parameters_of_its_own():
    vanilla, dpformer = _pair()
    assert [n for n, _ in vanilla.named_parameters()] == [n for n, _ in dpformer.named_parameters()]
    assert set(dpformer.state_dict()) - set(vanilla.state_dict()) == {
        "reattention.noise_std",
        "reattention.item_freq",
        "reattention.pos_freq",
    }


def test_without_noise_it_is_the_vanilla_transformer():
    vanilla, dpformer = _pair()
    ids = _ids()
    dpformer.set_token_frequencies(ids)
    assert torch.equal(vanilla(ids), dpformer(ids))


def test_frequencies_hand_computed():
    _, m = _pair()
    x = torch.tensor([[0, 0, 3, 3, 5, 1, 2, 2], [0, 0, 0, 0, 0, 0, 3, 4]])
    m.set_token_frequencies(x)
    f = m.reattention.item_freq
    assert f[3] == 1.0 and f[5] == 0.5 and f[1] == 0.5 and f[4] == 0.5  # 3 counted once per sequence
    assert f[7] == 0.5  # never seen: clamped to 1/N
    # positions 0-1 hold padding in both rows, 2-5 in one: 0-1 clamped to 1/N = 0.5
    assert m.reattention.pos_freq.tolist() == [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 1.0, 1.0]
    with pytest.raises(InvalidArgumentError, match="max_len"):
        m.set_token_frequencies(torch.ones(2, 9, dtype=torch.long))


def test_engine_sets_sigma_over_batch():
    _, m = _pair()
    m = m.float().train()
    x = _ids(b=40)
    engine = dpzoo.PrivacyEngine()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    engine.make_private(
        module=m,
        optimizer=opt,
        data_loader=DataLoader(TensorDataset(x), batch_size=10),
        noise_multiplier=1.3,
        max_grad_norm=0.5,
    )
    assert m.reattention.noise_std.item() == pytest.approx(1.3 * 0.5 / 10)
    engine.detach()


def test_attention_correction_matches_hand_formula():
    """Inside the model: logits minus C·σ_k²/2 with σ_k² from eq. 5.5 through LayerNorm and W_k,
    checked against the probability form S_i / exp(C σ_i²/2), renormalised."""
    _, m = _pair()
    ids = _ids()
    m.set_token_frequencies(ids[1:])
    m.set_dp_noise(noise_multiplier=2.0, max_grad_norm=1.0, expected_batch_size=4)
    ra, attn = m.reattention, m.blocks[0].attn
    d = SMALL["d_model"]
    var_w = (2.0 / 4) ** 2
    var0 = ra.input_variance(ids, d, math.sqrt(d))
    # item i's embedding error is (σR/B)/p_i (Claim 5.4), ×√d for the embedding scale, plus positions'
    expected = (math.sqrt(d) * 0.5 / ra.item_freq[ids]) ** 2 + (0.5 / ra.pos_freq[:8]) ** 2
    assert torch.allclose(var0, expected.masked_fill(ids == 0, 0))
    with torch.no_grad():
        x = m.item_emb(ids) * math.sqrt(d) + m.pos_emb(torch.arange(8).expand(4, 8))
        h = m.blocks[0].ln1(x)
        var_h = ep.iso_layer_norm(x, var0, m.blocks[0].ln1.weight, 1e-5, var_w, var_w)
        var_k = ep.iso_linear(h, var_h, attn.k.weight, var_w, var_w)
        s, q = attn.scores(h)
        allowed = torch.ones(8, 8, dtype=torch.bool).tril() & (ids != 0)[:, None, None, :]
        probs = torch.softmax(s.masked_fill(~allowed, -1e9), -1)
        expected = reference_reattention(probs, var_k[:, None, :], q / math.sqrt(attn.dk))
        out = attn(h, ids != 0, score_correction=ep.key_noise_correction(attn, var_h, var_w))
        v = attn.v(h).view(4, 8, attn.h, attn.dk).transpose(1, 2)
        ref = attn.o((expected @ v).transpose(1, 2).reshape(4, 8, d))
    real = ids != 0  # padding query rows attend uniformly to -1e9 logits either way (loss-free)
    assert torch.allclose(out[real], ref[real], atol=1e-10)
    # and the correction is not a no-op here
    assert not torch.allclose(expected, probs, atol=1e-3)


def test_rare_keys_get_less_attention():
    """Attention distraction (eq. 5.2) corrected: the key of a rare item loses attention weight
    relative to the vanilla softmax, the key of a frequent one gains."""
    _, m = _pair()
    ids = _ids()
    m.set_dp_noise(noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=64)
    freq = torch.full((SMALL["num_items"] + 1,), 0.5, dtype=torch.float64)
    rare = int(ids[1, 2])
    freq[ids[1, 2:]] = 0.5
    freq[rare] = 0.01
    m.reattention.item_freq.copy_(freq)
    attn, d = m.blocks[0].attn, SMALL["d_model"]
    with torch.no_grad():
        x = m.item_emb(ids) * math.sqrt(d) + m.pos_emb(torch.arange(8).expand(4, 8))
        h = m.blocks[0].ln1(x)
        var0 = m.reattention.input_variance(ids, d, math.sqrt(d))
        var_h = ep.iso_layer_norm(x, var0, m.blocks[0].ln1.weight, 1e-5, 1 / 64**2, 1 / 64**2)
        var_k = ep.iso_linear(h, var_h, attn.k.weight, 1 / 64**2, 1 / 64**2)
        s, q = attn.scores(h)
        probs = torch.softmax(s[1:2, :, -1:].masked_fill(torch.arange(8) > 7, -1e9), -1)  # last query
        corrected = reference_reattention(probs, var_k[1:2, None, :], q[1:2, :, -1:] / math.sqrt(attn.dk))
    assert var_k[1, 2] > 10 * var_k[1, 3]
    assert corrected[0, 0, 0, 2] < 0.9 * probs[0, 0, 0, 2]  # the rare key loses weight
    assert corrected[0, 0, 0, 3] > probs[0, 0, 0, 3]  # a frequent key gains it


def test_per_sample_norms_with_reattention_active():
    """The correction is a constant for autograd: per-sample norms and clipped sums still equal
    the brute-force loop (Phantom Clipping on the tied embedding included)."""
    model, inputs, loss_fn = zoo_model_and_inputs("dpformer")
    model.set_token_frequencies(inputs["ids"])
    model.set_dp_noise(noise_multiplier=3.0, max_grad_norm=1.0, expected_batch_size=2)
    for mode in ("auto", "ghost", "instantiate"):
        check_against_brute_force(model, inputs, loss_fn, mode)


def test_correction_changes_outputs_but_is_cheap():
    vanilla, dpformer = _pair()
    ids = _ids()
    dpformer.set_token_frequencies(ids)
    dpformer.set_dp_noise(noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4)
    assert not torch.allclose(vanilla(ids), dpformer(ids))


def test_cli_trains_dpformer_on_synthetic(tmp_path, capsys):
    from dpzoo.cli import main

    assert (
        main(
            [
                "train",
                "dpformer",
                "--data",
                "synthetic",
                "--epochs",
                "2",
                "--eval-every",
                "1",
                "--epsilon",
                "5",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    m = dpzoo.load(tmp_path / "model")
    assert m.reattention is not None and m.reattention.noise_std > 0
    assert (m.reattention.item_freq < 1).any()
    assert dpzoo.privacy_metadata(tmp_path / "model")["privacy_unit"] == "user"


def test_non_private_reference_trains_without_noise_or_metadata(tmp_path):
    """The reference run used to read DP results: same model and schedule, no engine."""
    from dpzoo.seqrec.train import train_seqrec

    result = train_seqrec(
        "dpformer",
        data="synthetic",
        epochs=1,
        batch_size=128,
        lr=3e-3,
        eval_every=1,
        private=False,
        out=tmp_path,
        log=lambda *a: None,
    )
    assert result["private"] is False and result["history"][0]["epsilon"] is None
    assert result["noise_multiplier"] == 0.0
    m = dpzoo.load(tmp_path / "model")
    assert float(m.reattention.noise_std) == 0.0  # Re-Attention is exactly off without DP noise
    assert dpzoo.privacy_metadata(tmp_path / "model") is None


def test_cli_refuses_non_private_for_image_models(capsys):
    from dpzoo.cli import main

    assert main(["train", "resnet18-gn-bias", "--non-private", "--epochs", "1"]) == 2
    assert "--non-private is for sequence models" in capsys.readouterr().err


def test_every_parameter_gets_a_gradient_with_reattention_active():
    """Re-Attention's correction is a constant, but the scores it corrects must stay in the graph:
    with the noise set, the attention's query and key weights still train (regression: the
    correction was once subtracted under no_grad, detaching the scores)."""
    _, dpformer = _pair()
    ids = _ids()
    dpformer.set_token_frequencies(ids)
    dpformer.set_dp_noise(noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4)
    dpformer(ids).logsumexp(-1).sum().backward()
    for name, p in dpformer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"{name} got no gradient"


@pytest.mark.parametrize("name", ["dpformer", "transformer-seqrec"])
def test_positions_start_at_the_items_scale(name):
    """nn.Embedding's default N(0, 1) positions drowned the items (0.02·√d): init std 0.02."""
    model = dpzoo.load(name, num_items=500, max_len=64, d_model=32)
    assert 0.015 < model.pos_emb.weight.std().item() < 0.025
    assert 0.015 < model.item_emb.weight.std().item() < 0.025
