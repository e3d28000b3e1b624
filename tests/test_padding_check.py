"""The self-check's padding check (dpzoo.privacy.padding_check): a collate that pads each batch to
its longest sequence is accepted when every sample's outputs and loss gradient are those it has
alone (an attention mask the model honours, labels padded with ignore_index), and refused when the
padding reaches a sample's gradient (a model that reads padding: tests/test_independent_audit.py;
a loss that counts padded positions: here)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader

import dpzoo
from dpzoo.errors import ReproducibleNoiseWarning, SelfCheckError


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=40, n_embd=16, n_layer=1, n_head=2, n_positions=16, bos_token_id=0, eos_token_id=0,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return GPT2LMHeadModel(cfg).double()


def sequences():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(1, 40, (int(n),), generator=g) for n in (3, 9, 5, 2, 7, 4)]


def collate(label_padding):
    def pad(items):
        ids = pad_sequence(items, batch_first=True, padding_value=0)
        mask = pad_sequence([torch.ones_like(t) for t in items], batch_first=True)
        labels = pad_sequence(items, batch_first=True, padding_value=label_padding)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    return pad


def private(model, data):
    """(engine, model, optimizer, loader) made private, the self-check on (it runs the padding check)."""
    engine = dpzoo.PrivacyEngine()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReproducibleNoiseWarning)
        model, opt, loader = engine.make_private(
            module=model, optimizer=opt, data_loader=data, noise_multiplier=1.0, max_grad_norm=1.0, sample_seed=0
        )
    return engine, model, opt, loader


def lm_backward(collate_fn):
    """The tiny GPT-2's first batch through ``collate_fn``, its labels= loss back-propagated: (engine,
    optimizer, batch); the self-check runs at ``opt.step()``."""
    engine, model, opt, loader = private(tiny_gpt2(), DataLoader(sequences(), batch_size=6, collate_fn=collate_fn))
    batch = next(iter(loader))
    model(**batch).loss.backward()
    return engine, opt, batch


def one_step(label_padding):
    engine, opt, batch = lm_backward(collate(label_padding))
    assert batch["input_ids"].shape[1] > 2  # padded: the samples' lengths differ
    opt.step()
    return engine


def test_right_padding_with_a_mask_and_ignored_labels_is_accepted():
    engine = one_step(label_padding=-100)
    assert engine.steps == 1 and engine.self_check_result.startswith("passed")


def test_labels_padded_with_a_token_are_refused():
    """Padded positions labelled with token 0: each sample's token mean counts the batch's padding."""
    with pytest.raises(SelfCheckError, match="gradient on its padding positions"):
        one_step(label_padding=0)


def truncating(items):
    ids = torch.stack([t[: min(len(u) for u in items)] for t in items])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def test_a_collate_that_truncates_to_the_batchs_shortest_is_refused():
    """26th audit: 1.7 R, silent (each sample's prefix matched its row)."""
    engine, opt, _ = lm_backward(truncating)
    with pytest.raises(SelfCheckError, match="truncates samples to the batch's shortest"):
        opt.step()


class Pool(torch.nn.Module):
    """Mean of the token embeddings under a mask the loop builds: over the padded length (reads the
    padding) or over the sample's own tokens."""

    def __init__(self, own_length):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.out, self.own_length = torch.nn.Embedding(40, 4), torch.nn.Linear(4, 3), own_length

    def forward(self, ids, mask):
        h = torch.tanh(self.emb(ids)) * mask.unsqueeze(-1)
        return self.out(h.sum(1) / (mask.sum(1, keepdim=True) if self.own_length else ids.shape[1]))


@pytest.mark.parametrize(
    "own_length, copied",
    [(False, False), (True, False), (False, True)],
    ids=["over-the-padded-length", "over-its-own-tokens", "the-batch-copied-as-to(device)-would"],
)
def test_a_mask_built_in_the_loop_is_cut_to_each_sample(own_length, copied):
    """26th audit: a mask derived in the loop made the run alone fail and the check give up (1.1 R)."""
    labels = [int(t[0]) % 3 for t in sequences()]
    data = DataLoader(
        list(zip(sequences(), labels)),
        batch_size=6,
        collate_fn=lambda b: (pad_sequence([t for t, _ in b], batch_first=True), torch.tensor([y for _, y in b])),
    )
    engine, model, opt, loader = private(Pool(own_length).double(), data)
    ids, y = next(iter(loader))
    ids = ids.clone() if copied else ids  # other storage: found by its values
    torch.nn.functional.cross_entropy(model(ids, (ids != 0).double()), y).backward()
    if own_length:
        opt.step()
        assert engine.self_check_result.startswith("passed")
    else:
        with pytest.raises(SelfCheckError, match="outputs differ"):
            opt.step()


def random_masking(items):
    """Pads, then replaces tokens at random (a masked-LM collate): each call draws anew."""
    batch = collate(-100)(items)
    drawn = torch.rand(batch["input_ids"].shape) < 0.3
    batch["input_ids"] = torch.where(drawn & (batch["attention_mask"] == 1), 39, batch["input_ids"])
    return batch


def test_a_collate_that_draws_at_random_is_not_refused():
    """The sample run alone is its row of the batch without the padding, not a new draw."""
    engine, opt, _ = lm_backward(random_masking)
    opt.step()
    assert engine.self_check_result.startswith("passed")
