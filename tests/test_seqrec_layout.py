"""dpzoo.seqrec's layout (issue 14): one job per module, no import cycle with dpzoo.models,
test-only references outside the public API, the engine's noise protocol."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpzoo
from dpzoo.privacy.protocols import NoiseAware

ROOT = Path(__file__).resolve().parents[1]
SEQREC = sorted((ROOT / "dpzoo" / "seqrec").glob("*.py"))
ENTRIES = ["transformer-seqrec", "transformer-seqrec-untied", "dpformer", "gru-seqrec", "lstm-seqrec"]


def _top_level_imports(path: Path) -> set[str]:
    """Modules a file imports when it is loaded (imports inside functions excluded), resolved."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            mod = ".".join(p for p in (base, node.module or "") if p)
            out |= {mod} | {f"{mod}.{a.name}" for a in node.names}
    return out


@pytest.mark.parametrize("path", SEQREC, ids=lambda p: p.name)
def test_seqrec_never_imports_models_at_load_time(path):
    assert not [m for m in _top_level_imports(path) if m == "dpzoo.models" or m.startswith("dpzoo.models.")]


@pytest.mark.parametrize("path", SEQREC, ids=lambda p: p.name)
def test_one_documented_job_per_module(path):
    tree = ast.parse(path.read_text())
    assert ast.get_docstring(tree), f"{path.name} has no module docstring"
    assert len(path.read_text().splitlines()) <= 400, f"{path.name} is over 400 lines"


@pytest.mark.parametrize(
    "first", ["dpzoo.seqrec.zoo", "dpzoo.seqrec.modeling", "dpzoo.seqrec.train", "dpzoo.models", "dpzoo.seqrec"]
)
def test_import_order_does_not_matter(first):
    """Whatever is imported first, loading it does not load dpzoo.models (unless it is it), and
    the registry then lists the five sequential-recommendation entries."""
    code = (
        f"import sys, {first}\n"
        f"assert ({first!r} == 'dpzoo.models') == ('dpzoo.models' in sys.modules), sorted(sys.modules)\n"
        "import dpzoo\n"
        f"assert set({ENTRIES!r}) <= set(dpzoo.list_models())\n"
        "from dpzoo.seqrec import zoo; zoo.register()\n"  # idempotent
        "print(type(dpzoo.load('dpformer', num_items=5, max_len=4, d_model=8)).__module__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "dpzoo.seqrec.modeling"


def test_models_package_reaches_seqrec_only_to_register():
    for path in sorted((ROOT / "dpzoo" / "models").glob("*.py")):
        seqrec = {m for m in _top_level_imports(path) if m.startswith("dpzoo.seqrec")}
        assert seqrec <= ({"dpzoo.seqrec", "dpzoo.seqrec.zoo"} if path.name == "__init__.py" else set()), path.name


def test_test_only_references_are_not_public_api():
    from dpzoo.seqrec import reattention

    for name in ("paper_eq_5_6", "linear", "reattention", "elementwise", "gelu", "iso_gelu"):
        assert not hasattr(reattention, name), name
    used = [
        p
        for d in ("dpzoo", "examples", "benchmarks")
        if (ROOT / d).is_dir()
        for p in (ROOT / d).rglob("*.py")
        if "paper_eq_5_6" in p.read_text() or "seqrec_reference" in p.read_text()
    ]
    assert used == []


# -- the noise protocol -------------------------------------------------------------------------


class _Listener(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.calls = []

    def forward(self, x):
        return self.lin(x)

    def set_dp_noise(self, *, noise_multiplier, max_grad_norm, expected_batch_size):
        self.calls.append((noise_multiplier, max_grad_norm, expected_batch_size))


def test_noise_aware_is_structural():
    assert isinstance(_Listener(), NoiseAware)
    assert isinstance(dpzoo.load("dpformer", num_items=5, max_len=4, d_model=8).reattention, NoiseAware)
    assert not isinstance(nn.Linear(2, 2), NoiseAware)


def test_engine_tells_every_noise_aware_module():
    model = nn.Sequential(_Listener(), nn.Linear(2, 1))
    model[1].set_dp_noise = "not a method"  # an attribute of that name that is not callable is skipped
    engine = dpzoo.PrivacyEngine()
    data = DataLoader(TensorDataset(torch.randn(40, 3), torch.randn(40, 1)), batch_size=8)
    engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=data,
        noise_multiplier=1.5,
        max_grad_norm=0.7,
    )
    assert model[0].calls == [(1.5, 0.7, pytest.approx(8.0))]
    engine.detach()
