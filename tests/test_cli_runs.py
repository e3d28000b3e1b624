"""Long runs of ``dpzoo train``: a progress bar with loss and ε, metrics.csv and TensorBoard written
per evaluation, checkpoints, Ctrl-C (raised from a step callback, and a real SIGINT) and --resume
with the same ε bookkeeping (seeded: the same model bit for bit), the popularity reference."""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cli_errors import one_line_error
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpzoo
from dpzoo.cli import main
from dpzoo.runs.loop import TrainingLoop
from dpzoo.seqrec.metrics import ndcg_hit_at_k, target_ranks
from dpzoo.seqrec.train import get_dataset, popularity_baseline, train_seqrec

ROOT = Path(__file__).resolve().parents[1]
# a tiny sequence run: 500 synthetic users, q = 0.256, 4 steps an epoch
TINY = ["gru-seqrec", "--set", "d_model=8", "--max-len", "8", "--batch-size", "128", "--epochs", "2"]
TINY_KW = dict(epochs=2, batch_size=128, max_len=8, overrides={"d_model": 8}, eval_every=1)
_quiet = lambda message: None  # noqa: E731


# -- progress bar ----------------------------------------------------------------------------------------
def _tiny_private_loop(**kw):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    data = TensorDataset(torch.randn(40, 3), torch.randint(0, 2, (40,)))
    engine = dpzoo.PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=10),
        noise_multiplier=1.0,
        target_delta=1e-5,
        epochs=2,
    )
    loop = TrainingLoop(
        name="tiny", model=model, optimizer=opt, loader=loader, epochs=2, settings={}, engine=engine, delta=1e-5, **kw
    )

    def step(batch):
        loss = nn.functional.cross_entropy(model(batch[0]), batch[1])
        loss.backward()
        return loss

    return loop, step


def test_progress_bar_shows_loss_and_epsilon_and_is_quiet_off_a_terminal(capsys):
    loop, step = _tiny_private_loop(progress=True, log=_quiet)
    loop.run(step, lambda: {}, eval_every=1, describe=str)
    err = capsys.readouterr().err
    assert "8/8" in err and "loss=" in err and "ε=" in err
    loop, step = _tiny_private_loop(progress=None, log=_quiet)  # stderr is captured: not a terminal
    loop.run(step, lambda: {}, eval_every=1, describe=str)
    assert capsys.readouterr().err == ""


# -- a seeded run, the same run interrupted and resumed -------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A: uninterrupted (reading metrics.csv after every step); B: Ctrl-C after step 6 (in epoch 2),
    then `dpzoo train --resume`. Seeded noise and sampling: B must end exactly where A does."""
    root = tmp_path_factory.mktemp("runs")
    seeds = dict(noise_seed=11, sample_seed=12)
    rows_seen = {}

    def watch(step):
        path = root / "a" / "metrics.csv"
        rows_seen[step] = len(path.read_text().splitlines()) - 1 if path.exists() else 0

    with pytest.warns(dpzoo.ReproducibleNoiseWarning):
        a = train_seqrec("gru-seqrec", out=root / "a", log=_quiet, step_callback=watch, **TINY_KW, **seeds)

    def ctrl_c(step):
        if step == 6:
            raise KeyboardInterrupt

    with pytest.warns(dpzoo.ReproducibleNoiseWarning), pytest.raises(KeyboardInterrupt) as stop:
        train_seqrec("gru-seqrec", out=root / "b", log=_quiet, step_callback=ctrl_c, **TINY_KW, **seeds)
    interrupted = {
        "message": str(stop.value),
        "csv": (root / "b" / "metrics.csv").read_text(),
        "checkpoint": torch.load(root / "b" / "checkpoint.pt", weights_only=True),
    }
    code = main(["train", "--resume", str(root / "b"), "--quiet"])
    return root, a, rows_seen, interrupted, code


@pytest.mark.slow
def test_metrics_csv_is_written_per_evaluation(runs):
    root, a, rows_seen, _, _ = runs
    assert rows_seen[1] == 0 and rows_seen[4] == 0 and rows_seen[5] == 1 and rows_seen[8] == 1  # during the run
    with (root / "a" / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows] == [1, 2] and [int(r["step"]) for r in rows] == [4, 8]
    for row, kept in zip(rows, a["history"]):
        assert float(row["epsilon"]) == pytest.approx(kept["epsilon"], rel=1e-12)
        assert float(row["test_ndcg@10"]) == pytest.approx(kept["test_ndcg@10"], rel=1e-12)
    meta = dpzoo.privacy_metadata(root / "a" / "model")
    assert meta["epsilon"] == pytest.approx(a["epsilon"]) and a["steps"] == 8
    # the metadata counts every release composed into ε: the private item prior, then 8 steps
    assert meta["steps"] == 9 and meta["history"][0] == [5.0, 1.0, 1] and meta["history"][1][2] == 8
    assert (root / "a" / "metrics.png").stat().st_size > 0
    assert json.loads((root / "a" / "metrics.json").read_text())["popularity"]["test"]["ndcg@10"] >= 0


@pytest.mark.slow
def test_tensorboard_events_hold_every_evaluation(runs):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root, a, _, _, _ = runs
    events = EventAccumulator(str(root / "a" / "tensorboard"))
    events.Reload()
    eps = events.Scalars("epsilon")
    assert [e.step for e in eps] == [4, 8]
    assert [e.value for e in eps] == pytest.approx([h["epsilon"] for h in a["history"]], rel=1e-6)
    assert "test_hit@10" in events.Tags()["scalars"]


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_and_says_how_to_resume(runs):
    root, _, _, interrupted, _ = runs
    assert "interrupted after step 6 of 8" in interrupted["message"]
    assert f"dpzoo train --resume {root / 'b'}" in interrupted["message"]
    ckpt = interrupted["checkpoint"]
    assert ckpt["progress"]["step"] == 6 and ckpt["progress"]["epochs_done"] == 1
    assert ckpt["engine"]["accountant"]["history"] == [  # the item prior's release, then the steps
        [5.0, 1.0, 1],
        [pytest.approx(ckpt["engine"]["noise_multiplier"]), 0.256, 6],
    ]
    assert len(interrupted["csv"].splitlines()) == 2  # header and epoch 1: nothing after the checkpoint


@pytest.mark.slow
def test_resume_reproduces_the_uninterrupted_run(runs):
    root, a, _, _, code = runs
    assert code == 0
    b = json.loads((root / "b" / "metrics.json").read_text())
    assert b["steps"] == a["steps"] == 8 and b["epsilon"] == a["epsilon"]  # the same accounting, exactly
    meta_a, meta_b = dpzoo.privacy_metadata(root / "a" / "model"), dpzoo.privacy_metadata(root / "b" / "model")
    assert {k: meta_b[k] for k in ("epsilon", "steps", "noise_multiplier", "sample_rate", "accountant")} == {
        k: meta_a[k] for k in ("epsilon", "steps", "noise_multiplier", "sample_rate", "accountant")
    }
    assert meta_b["self_check"].startswith("passed")
    # seeded noise and sampling: the resumed model is the uninterrupted one, bit for bit
    ma, mb = dpzoo.load(root / "a" / "model"), dpzoo.load(root / "b" / "model")
    for (name, p), q in zip(ma.state_dict().items(), mb.state_dict().values()):
        assert torch.equal(p, q), name
    assert [h["test_ndcg@10"] for h in b["history"]] == [h["test_ndcg@10"] for h in a["history"]]
    with (root / "b" / "metrics.csv").open() as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == [4, 8]  # rewritten from the checkpoint, then appended


@pytest.mark.slow
def test_resume_refuses_other_settings_and_finished_runs(runs, capsys):
    root = runs[0]
    says = one_line_error(capsys, ["train", "--resume", str(root / "b"), "--epochs", "5"])
    assert "drop --epochs" in says
    says = one_line_error(capsys, ["train", "dpformer", "--resume", str(root / "b")])
    assert "is a run of gru-seqrec" in says
    assert "is complete" in one_line_error(capsys, ["train", "--resume", str(root / "b")])


def test_checkpoint_every_n_steps(tmp_path):
    seen = {}

    def look(step):
        ckpt = tmp_path / "checkpoint.pt"
        seen[step] = torch.load(ckpt, weights_only=True)["progress"]["step"] if ckpt.exists() else None

    train_seqrec(
        "gru-seqrec", out=tmp_path, log=_quiet, checkpoint_every=3, step_callback=look, **{**TINY_KW, "epochs": 1}
    )
    assert seen == {1: None, 2: None, 3: None, 4: 3}  # the callback runs before the step's checkpoint


def test_a_full_disk_while_checkpointing_is_one_line_and_leaves_the_last_checkpoint(tmp_path, monkeypatch, capsys):
    """torch.save on a full disk raises RuntimeError ("PytorchStreamWriter failed writing file") after
    writing part of the file: before, a 35-line traceback and checkpoint.pt.tmp left behind."""
    real_save, calls = torch.save, []

    def full_disk(obj, f, *a, **kw):
        calls.append(f)
        if len(calls) > 1:  # the first checkpoint fits, the second does not
            Path(f).write_bytes(b"partial")
            raise RuntimeError("[enforce fail at inline_container.cc:603] . PytorchStreamWriter failed writing file")
        return real_save(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", full_disk)
    out = tmp_path / "run"
    args = ["train", "cnn-tanh-gn", "--epochs", "2", "--checkpoint-every", "1", "--out", str(out), "--quiet"]
    line = one_line_error(capsys, args)
    assert "Could not write the checkpoint" in line and "previous checkpoint is kept" in line and "disk" in line
    assert not list(out.glob("*.tmp")) and (out / "checkpoint.pt").is_file()
    assert torch.load(out / "checkpoint.pt", weights_only=True)["progress"]["step"] == 1


@pytest.mark.slow
def test_sigint_in_a_real_process_then_resume_keeps_the_accounting(tmp_path):
    """A real Ctrl-C (secret noise): the run stops after the current step, saves, exits 130; the
    resumed run ends with the steps and ε of an uninterrupted run."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "dpzoo", "train", *TINY, "--epochs", "3", "--out", str(out), "--checkpoint-every", "1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not (out / "checkpoint.pt").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("dpzoo: gru-seqrec: interrupted after step") and f"--resume {out}" in last
    stopped = torch.load(out / "checkpoint.pt", weights_only=True)["progress"]["step"]
    assert 1 <= stopped < 12
    assert main(["train", "--resume", str(out), "--quiet"]) == 0
    resumed = json.loads((out / "metrics.json").read_text())
    reference = dpzoo.PrivacyEngine().accountant
    reference.step(5.0, 1.0, 1)  # the private item prior, released once before the first run's steps
    reference.step(resumed["noise_multiplier"], resumed["sample_rate"], 12)
    assert resumed["steps"] == 12 and resumed["epsilon"] == reference.get_epsilon(resumed["delta"])
    assert dpzoo.privacy_metadata(out / "model")["noise"].startswith("secret")


# -- an image run through the command line ----------------------------------------------------------------
@pytest.mark.slow
def test_image_run_writes_everything_and_quiet_prints_one_line(tmp_path, capsys):
    pytest.importorskip("sklearn")
    argv = ["train", "resnet18-gn-bias", "--epochs", "1", "--batch-size", "256", "--out", str(tmp_path), "--quiet"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert err == "" and len(out.strip().splitlines()) == 1 and "ε = " in out and "test_accuracy" in out
    names = {p.name for p in tmp_path.iterdir()}
    assert {"metrics.csv", "metrics.json", "model", "checkpoint.pt"} <= names
    assert "metrics.png" in names  # matplotlib is in the test extra
    with (tmp_path / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    meta = dpzoo.privacy_metadata(tmp_path / "model")
    assert len(rows) == 1 and int(rows[0]["step"]) == meta["steps"]
    assert float(rows[0]["epsilon"]) == pytest.approx(meta["epsilon"]) and meta["epsilon"] <= 8.0


# -- the popularity reference of sequence runs --------------------------------------------------------------
def test_popularity_baseline_matches_a_loop_over_users():
    ds = get_dataset("synthetic")
    got = popularity_baseline(ds, max_len=12)
    x, _ = ds.to_padded(12, "train")
    counts = torch.zeros(ds.num_items + 1)
    for row in x:  # sequences holding each item
        for item in set(row.tolist()) - {0}:
            counts[item] += 1
    for part in ("valid", "test"):
        inputs, targets = ds.to_padded(12, part)
        ranks = torch.stack(
            [target_ranks(counts[None], targets[i : i + 1], inputs[i : i + 1])[0] for i in range(len(targets))]
        )
        ndcg, hit = ndcg_hit_at_k(ranks)
        assert got[part] == {"ndcg@10": pytest.approx(ndcg, abs=1e-12), "hit@10": pytest.approx(hit, abs=1e-12)}
