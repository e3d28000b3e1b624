"""``max_physical_batch_size="auto"`` (dpzoo.seqrec.memory): the per-sample memory estimate and what
it is checked against (the measured peaks of a run), the micro-batch it chooses under a given memory figure,
where that figure comes from, runs split by it giving the DP update of whole batches, the command
line's option, the step's cost in the progress bar, and Amazon / SASRec files trained with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
from cli_errors import one_line_error

import dpzoo
from dpzoo import device_memory
from dpzoo.cli import build_parser, main
from dpzoo.errors import InvalidArgumentError
from dpzoo.grad_norms.cost import BUDGET_FRACTION, default_budget
from dpzoo.hub.load_save import load as hub_load
from dpzoo.losses import SequenceCrossEntropy
from dpzoo.runs.progress import StepBar
from dpzoo.seqrec import memory
from dpzoo.seqrec.train import train_seqrec

ROOT = Path(__file__).resolve().parents[1]
# 500 synthetic users, expected batch 128 (q = 0.256), 4 steps an epoch; no dropout: the same
# forward whether a batch is split or not
TINY_KW = dict(
    epochs=1,
    batch_size=128,
    max_len=8,
    overrides={"d_model": 8, "num_heads": 1, "dropout": 0.0},
    eval_every=1,
    log=lambda message: None,
)
SEEDS = dict(noise_seed=3, sample_seed=4)


def _model(name="transformer-seqrec", items=500, length=20, **over):
    return dpzoo.load(name, num_items=items, max_len=length, d_model=8, **over)


def _memory_for(model, length: int, samples: float) -> float:
    """An available-memory figure under which a first step of ``samples`` samples fills the budget."""
    per_sample = memory.sample_bytes(model, length) + memory.self_check_bytes(model, length)
    return (memory.fixed_bytes(model) + samples * per_sample) / memory.BUDGET_FRACTION


# -- the estimate ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["transformer-seqrec", "dpformer", "gru-seqrec", "lstm-seqrec"])
def test_the_estimate_grows_with_length_and_items_and_counts_several_logit_copies(name):
    base = memory.sample_bytes(_model(name, 200, 40), 20)
    longer = memory.sample_bytes(_model(name, 200, 40), 40)
    more_items = memory.sample_bytes(_model(name, 800, 40), 20)
    assert base < longer and base < more_items
    # 600 more items at T = 20: the softmax's logits, their log-softmax and gradients, several copies
    logit = 20 * 600 * 4  # one fp32 copy
    assert 3 * logit <= more_items - base <= 6 * logit
    # mode "instantiate" holds per-sample gradients of every parameter besides
    model = _model(name, 200, 40)
    params = sum(p.numel() for p in model.parameters()) * 4
    assert memory.sample_bytes(model, 20, "instantiate") - memory.sample_bytes(model, 20, "bk") >= params


def test_the_estimate_is_refused_for_a_model_it_does_not_know():
    with pytest.raises(InvalidArgumentError, match="give a number of samples"):
        memory.sample_bytes(torch.nn.Linear(3, 3), 10)


_MEASURE = r"""
import json, random, sys, warnings
import torch
from dpzoo.seqrec import memory
from dpzoo.seqrec.train import train_seqrec
torch.set_num_threads(1)
warnings.simplefilter("ignore")
V, T = 1000, 100
rnd = random.Random(0)
path = sys.argv[1]
with open(path, "w") as f:
    f.write("".join(f"{u} {rnd.randrange(1, V + 1)}\n" for u in range(1, 401) for _ in range(T + 3)))

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

seen = {}

def reset():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark VmHWM starts again from the current resident size
    seen["base"] = status("VmRSS:")

def available(device):  # read just before make_private: measure from here, and choose K
    model = seen["model"]
    reset()
    per_sample = memory.sample_bytes(model, T) + memory.self_check_bytes(model, T)
    return (memory.fixed_bytes(model) + (seen["K"] + 0.5) * per_sample) / memory.BUDGET_FRACTION, "test"

real_choose = memory.choose_physical_batch
memory.available_memory = available

def choose(value, model, **kw):
    seen["model"] = model
    return real_choose(value, model, **kw)

import dpzoo.seqrec.train as train
train.choose_physical_batch = choose

def run(K):
    seen["K"], peaks = K, []

    def after(step):
        peaks.append(status("VmHWM:") - seen["base"])
        reset()
        if step == 3:
            raise KeyboardInterrupt

    try:
        train_seqrec("transformer-seqrec", data=path, epochs=1, batch_size=4 * K, max_len=T, step_callback=after,
                     overrides={"d_model": 16, "num_heads": 2}, item_prior="none", log=lambda m: None)
    except KeyboardInterrupt:
        pass
    return peaks

run(4)  # first calls of torch's kernels, lazy imports: not the estimate's business
peaks = run(32)
model = seen["model"]
print(json.dumps({"first": peaks[0], "later": max(peaks[1:]), "estimated_first": memory.fixed_bytes(model)
    + 32 * (memory.sample_bytes(model, T) + memory.self_check_bytes(model, T)),
    "estimated_later": 32 * memory.sample_bytes(model, T)}))
"""


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's /proc/self/clear_refs")
def test_the_estimate_matches_the_measured_peaks_of_a_run(tmp_path):
    """The peak resident memory of a run's first step (with the engine's self-check) and of its later
    steps, with micro-batches of 32 chosen by "auto", against the estimates (after a warm-up run);
    glibc's mmap threshold is set low so that freed tensors leave the process and the high-water
    mark counts live tensors."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(tmp_path / "users.txt")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        check=True,
    )
    r = json.loads([ln for ln in done.stdout.splitlines() if ln.startswith("{")][-1])
    assert r["first"] <= r["estimated_first"] <= 1.6 * r["first"], r  # the run's highest step fits the estimate
    assert 0.85 * r["later"] <= r["estimated_later"] <= 1.6 * r["later"], r
    assert r["later"] < r["first"], r  # the self-check makes the first step the highest


# -- the choice --------------------------------------------------------------------------------------------
def test_less_memory_gives_a_smaller_micro_batch_never_more_than_the_batch(monkeypatch):
    model = _model(length=20)
    figures = {}
    for samples in (5000, 100.5, 40.5, 0.2):
        monkeypatch.setattr(memory, "available_memory", lambda device, s=samples: (_memory_for(model, 20, s), "test"))
        figures[samples] = memory.choose_physical_batch("auto", model, max_len=20, batch_size=256, device="cpu")
    assert figures[5000].size is None  # the expected batch fits: whole batches
    assert (figures[100.5].size, figures[40.5].size, figures[0.2].size) == (100, 40, 1)
    for chosen in figures.values():
        assert chosen.auto and chosen.available_bytes is not None
    chosen = figures[40.5]
    assert chosen.peak_bytes() <= memory.BUDGET_FRACTION * chosen.available_bytes
    assert chosen.peak_bytes() + chosen.sample_bytes > memory.BUDGET_FRACTION * chosen.available_bytes
    assert chosen.describe().startswith("physical batches of at most 40 (auto: ")
    assert figures[5000].describe().startswith("whole batches of about 256 (auto: ")
    # a number or None is taken as given, without reading the memory
    monkeypatch.setattr(memory, "available_memory", lambda device: pytest.fail("read the memory"))
    assert memory.choose_physical_batch(7, model, max_len=20, batch_size=256, device="cpu").size == 7
    assert memory.choose_physical_batch(None, model, max_len=20, batch_size=256, device="cpu").size is None


def test_available_memory_reads_meminfo_then_a_cgroup_limit_then_psutil(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  1000 kB\nMemAvailable:   20000000 kB\n")
    limit, usage = tmp_path / "memory.max", tmp_path / "memory.current"
    monkeypatch.setattr(device_memory, "MEMINFO", meminfo)
    monkeypatch.setattr(device_memory, "CGROUP_FILES", ((limit, usage),))
    assert memory.available_memory("cpu") == (20000000 * 1024, "MemAvailable")  # no cgroup files
    limit.write_text("max\n")
    usage.write_text("123\n")
    assert memory.available_memory("cpu") == (20000000 * 1024, "MemAvailable")
    limit.write_text(str(8 * 2**30))
    usage.write_text(str(3 * 2**30))
    assert memory.available_memory("cpu") == (5 * 2**30, "MemAvailable, cgroup limit")
    monkeypatch.setattr(device_memory, "MEMINFO", tmp_path / "absent")
    monkeypatch.setitem(
        sys.modules, "psutil", types.SimpleNamespace(virtual_memory=lambda: types.SimpleNamespace(available=7e9))
    )
    assert memory.available_memory("cpu") == (7e9, "psutil")
    monkeypatch.setitem(sys.modules, "psutil", None)  # not installed
    assert memory.available_memory("cpu") == (memory.ASSUMED_AVAILABLE, "assumed")
    # the hook planner's default budget reads the same figure (it read MemFree before)
    monkeypatch.setattr(device_memory, "MEMINFO", meminfo)
    assert default_budget(torch.device("cpu")) == pytest.approx(BUDGET_FRACTION * 5 * 2**30)


# -- runs --------------------------------------------------------------------------------------------------
def _traced_run(monkeypatch, name="transformer-seqrec", **kw):
    """train_seqrec, returning (result, the trained model, its initial weights, the rows of every
    forward-backward pass)."""
    built, rows = [], []

    class Counting(SequenceCrossEntropy):
        def forward(self, logits, target):
            rows.append(int(target.shape[0]))
            return super().forward(logits, target)

    def load(*args, **kwargs):
        built.append(hub_load(*args, **kwargs))
        initial.update({k: v.clone() for k, v in built[0].state_dict().items()})
        return built[0]

    initial: dict = {}
    monkeypatch.setattr(dpzoo.seqrec.train, "load", load)
    monkeypatch.setattr(dpzoo.seqrec.train, "SequenceCrossEntropy", Counting)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dpzoo.ReproducibleNoiseWarning)
        result = train_seqrec(name, **kw)
    return result, built[0], initial, rows


def test_auto_splits_batches_under_little_memory_and_the_dp_update_is_that_of_whole_batches(monkeypatch):
    whole, whole_model, initial, whole_rows = _traced_run(monkeypatch, max_physical_batch_size=None, **TINY_KW, **SEEDS)
    monkeypatch.setattr(memory, "available_memory", lambda device: (_memory_for(whole_model, 8, 50.5), "test"))
    split, split_model, _, split_rows = _traced_run(monkeypatch, max_physical_batch_size="auto", **TINY_KW, **SEEDS)
    assert whole["physical_batch"]["max_physical_batch_size"] is None and not whole["physical_batch"]["auto"]
    assert split["physical_batch"]["max_physical_batch_size"] == 50 and split["physical_batch"]["auto"]
    # the same Poisson batches (seeded), each cut into micro-batches of at most 50 rows
    assert len(whole_rows) == whole["steps"] == 4 and min(whole_rows) > 50
    assert split_rows == [min(50, b - s) for b in whole_rows for s in range(0, b, 50)]
    # one DP step per logical batch: the same ε, the same update (up to float summation order)
    assert (split["steps"], split["epsilon"]) == (whole["steps"], whole["epsilon"])
    trained, other = whole_model.state_dict(), split_model.state_dict()
    for name, a in trained.items():
        # summation order only: differences of ~1e-6 (Adam scales them up), where training moved
        # every weight by ~3e-2, and noise drawn per micro-batch would move them apart by as much
        assert torch.allclose(a, other[name], rtol=1e-4, atol=1e-5), name
    assert not torch.allclose(trained["item_emb.weight"], initial["item_emb.weight"], atol=1e-3)  # it trained


def _amazon_csv(path: Path, users=80, items=40, per_user=8) -> Path:
    """Shaped like the 2014 ratings-only release: user,item,rating,timestamp, no header."""
    g = torch.Generator().manual_seed(0)
    lines = []
    for u in range(users):
        for k, i in enumerate(torch.randperm(items, generator=g)[:per_user].tolist()):
            lines.append(f"A{u:013d},B{i:09d},5.0,{1_300_000_000 + 1000 * u + k}\n")
    path.write_text("".join(lines))
    return path


def _sasrec_text(path: Path, users=80, items=40, per_user=8) -> Path:
    g = torch.Generator().manual_seed(1)
    rows = [
        f"{u} {i + 1}\n" for u in range(1, users + 1) for i in torch.randperm(items, generator=g)[:per_user].tolist()
    ]
    path.write_text("".join(rows))
    return path


def test_an_amazon_csv_and_sasrec_text_train_one_epoch_with_auto(tmp_path, monkeypatch):
    kw = dict(TINY_KW, batch_size=32)
    probe = _model(items=40, length=8, num_heads=1, dropout=0.0)
    with monkeypatch.context() as m:  # little memory: the Amazon run splits its batches
        m.setattr(memory, "available_memory", lambda device: (_memory_for(probe, 8, 10.5), "test"))
        amazon, _, _, rows = _traced_run(m, data=str(_amazon_csv(tmp_path / "ratings_Video_Games.csv")), **kw)
    assert amazon["dataset"]["users"] == 80 and amazon["dataset"]["items"] == 40
    assert amazon["physical_batch"]["auto"] and amazon["physical_batch"]["max_physical_batch_size"] == 10
    assert max(rows) <= 10 and len(rows) > amazon["steps"]
    sasrec, _, _, rows = _traced_run(monkeypatch, data=str(_sasrec_text(tmp_path / "games.txt")), **kw)
    assert sasrec["dataset"]["users"] == 80
    assert sasrec["physical_batch"]["auto"] and sasrec["physical_batch"]["max_physical_batch_size"] is None
    assert len(rows) == sasrec["steps"]  # this machine's memory holds whole batches of 32
    for r in (amazon, sasrec):
        assert r["steps"] == 2 and 0 < r["epsilon"] <= 5.0 + 1e-6
        assert 0 <= r["history"][-1]["test_ndcg@10"] <= 1


# -- the command line and the Python arguments -------------------------------------------------------------


def test_the_option_takes_auto_or_a_number_and_refuses_junk(capsys):
    parser = build_parser()
    assert (
        parser.parse_args(["train", "gru-seqrec", "--max-physical-batch-size", "auto"]).max_physical_batch_size
        == "auto"
    )
    assert parser.parse_args(["train", "gru-seqrec", "--max-physical-batch-size", "16"]).max_physical_batch_size == 16
    for junk in ("atuo", "0", "-3", "1.5", "AUTO"):
        line = one_line_error(capsys, ["train", "gru-seqrec", "--max-physical-batch-size", junk])
        assert "--max-physical-batch-size" in line and "expected 'auto'" in line and repr(junk) in line, line
    line = one_line_error(capsys, ["train", "resnet18-gn-bias", "--max-physical-batch-size", "auto"])
    assert "auto is for sequence models" in line


@pytest.mark.parametrize("bad", ["Auto", 0, -2, 2.5, True, "16"])
def test_python_refuses_bad_values_before_training(bad):
    with pytest.raises(InvalidArgumentError, match="max_physical_batch_size must be 'auto'") as e:
        train_seqrec("gru-seqrec", max_physical_batch_size=bad, **TINY_KW)
    assert len(str(e.value).splitlines()) == 1 and repr(bad) in str(e.value)


def test_the_command_line_defaults_to_auto_for_sequence_models_and_takes_a_number(tmp_path, capsys):
    tiny = ["gru-seqrec", "--set", "d_model=8", "--max-len", "8", "--batch-size", "128", "--epochs", "1"]
    assert main(["train", *tiny, "--out", str(tmp_path / "a"), "--checkpoint-every", "off"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "; whole batches of about 128 (auto: " in first and "available)" in first, first
    assert main(["train", *tiny, "--quiet", "--out", str(tmp_path / "b"), "--max-physical-batch-size", "50"]) == 0
    a = json.loads((tmp_path / "a" / "metrics.json").read_text())["physical_batch"]
    b = json.loads((tmp_path / "b" / "metrics.json").read_text())["physical_batch"]
    assert a["auto"] and a["max_physical_batch_size"] is None and a["available_bytes"] > 0
    assert not b["auto"] and b["max_physical_batch_size"] == 50 and b["available_bytes"] is None


# -- the progress bar --------------------------------------------------------------------------------------
def test_the_progress_bar_shows_seconds_per_step_and_micro_batches(capsys, monkeypatch):
    now = [0.0]
    monkeypatch.setattr("dpzoo.runs.progress.time.monotonic", lambda: now[0])
    for micro, shown in ((4, "3.2 s/step · 4 micro-batches]"), (1, "3.2 s/step]"), (None, "3.2 s/step]")):
        with StepBar(3, "job", enabled=True) as bar:
            for _ in range(3):
                now[0] += 3.2
                bar.step(1.0, micro_batches=micro)
        err = capsys.readouterr().err  # tqdm draws the last step's text when the bar ends
        assert err.rstrip().endswith(f"loss=1, {shown}"), err  # whole steps: no micro-batch count
    with StepBar(2, "quiet", enabled=False) as bar:  # off: nothing shown, nothing timed
        bar.step(1.0, micro_batches=4)
    assert capsys.readouterr().err == ""
