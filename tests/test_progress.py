"""The per-step progress bar of long jobs (dpzoo.runs.progress.StepBar): training runs (tests/test_cli_runs.py),
DP-FROST selection and audits here; each shows its steps and ε on a terminal and nothing otherwise."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpzoo
from dpzoo import frost
from dpzoo.cli import main
from dpzoo.runs.progress import StepBar


def test_step_bar_shows_loss_and_epsilon_and_asks_the_accountant_sparingly(capsys, monkeypatch):
    asked = []
    clock = iter(range(0, 10_000, 1))  # each monotonic() call: one more second
    monkeypatch.setattr("dpzoo.runs.progress.time.monotonic", lambda: float(next(clock)))
    with StepBar(20, "job", enabled=True, epsilon=lambda: asked.append(1) or 0.5 * len(asked)) as bar:
        for i in range(20):
            bar.step(torch.tensor(2.0 - 0.1 * i))
    err = capsys.readouterr().err
    assert "job" in err and "20/20" in err and "loss=0.1" in err and "ε=" in err
    # ε is asked for at most once per 10x the time it took (here: 1 s each) and on the last step
    assert 1 < len(asked) < 20


def test_step_bar_is_quiet_off_a_terminal_and_when_disabled(capsys):
    asked = []
    for enabled in (None, False):  # None: tqdm's own test, and capsys' stderr is no terminal
        with StepBar(3, "job", enabled=enabled, epsilon=lambda: asked.append(1) or 1.0) as bar:
            for _ in range(3):
                bar.step(1.0)
            bar.say("a line", print)
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == "a line\na line\n" and asked == []


def test_frost_selection_shows_its_iterations_and_spend(capsys):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 3))
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(200, 6, generator=g), torch.randint(0, 3, (200,), generator=g))
    sel = frost.select(
        model, DataLoader(ds, batch_size=20), 4.0, 1e-5, ratio=0.5, epochs=1, sample_rate=0.1, progress=True
    )
    err = capsys.readouterr().err
    assert "DP-FROST selection" in err and "5/5" in err
    assert f"ε={sel.accountant.get_epsilon(1e-5):.3g}" in err  # the last step shows the selection's spend
    assert sel.accountant.history == [[sel.selection_noise_multiplier, 0.1, 5]]
    frost.select(model, DataLoader(ds, batch_size=20), 4.0, 1e-5, epochs=1, sample_rate=0.1, freeze=False)
    assert capsys.readouterr().err == ""  # not a terminal


def test_audit_shows_its_training_steps_and_the_quiet_flag_hides_them(capsys, tmp_path):
    r = dpzoo.audit(epsilon=2.0, canaries=20, epochs=1, batch_size=128, progress=True)
    err = capsys.readouterr().err
    steps = r.mechanism["steps"]
    assert "audit" in err and f"{steps}/{steps}" in err and "loss=" in err and "ε=" in err
    assert main(["audit", "--canaries", "20", "--epochs", "1", "--batch-size", "128", "--quiet"]) == 0
    assert capsys.readouterr().err == ""
