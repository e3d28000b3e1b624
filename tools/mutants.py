"""The mutation check: inject each privacy bug in turn and require the privacy tests to fail.

A test suite that passes whatever the clip factor is cannot vouch for ε. This module is both

- a pytest plugin (``-p mutants``): with ``DPZOO_MUTANT=<name>`` in the environment it patches
  dpzoo at session start with that bug (:data:`MUTANTS`), and
- the runner (``python tools/mutants.py``): for each mutant it runs the privacy subset
  (:data:`SUBSET`) under the plugin with ``-x`` and requires it to fail; it prints which tests
  killed each mutant and exits 1 naming every mutant that survived.

``.ci/run`` runs it after the suite (a few minutes on 2 cores: a killed mutant stops at its first
failing test).

    python tools/mutants.py                       # every mutant
    python tools/mutants.py --only no-clipping    # one
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# the tests that exist to catch these bugs: the DP step against closed-form brute force, the
# privacy edges, sensitivity probes, noise statistics and accounting references
SUBSET = [
    "tests/test_engine.py",
    "tests/test_privacy_edges.py",
    "tests/test_dp_mechanism.py",
    "tests/test_accounting.py",
    "tests/test_grad_norms_adversarial.py",  # the graph audit's refusals (last: only audit-blind runs it first)
]
# where a mutant's killing tests are, run first (the same tests either way: only the order, so a
# killed mutant stops sooner; one that survives still runs every test of the subset)
FIRST = {
    "secret-noise-x2": "tests/test_dp_mechanism.py",
    "secret-noise-x0.5": "tests/test_dp_mechanism.py",
    "accountant-last-entry-only": "tests/test_accounting.py",
    "audit-blind": "tests/test_grad_norms_adversarial.py",
}
# the plugin, stop at the first failure (a killed mutant), no cache, warnings not errors
PYTEST_ARGS = ["-p", "mutants", "-x", "-q", "-p", "no:cacheprovider", "-W", "ignore"]


def _wrap_clip(transform):
    from dpzoo.privacy.optimizer import DPOptimizer

    original = DPOptimizer.clip_factors

    def clip_factors(self, norms):
        return transform(self, original(self, norms))

    DPOptimizer.clip_factors = clip_factors


def no_clipping():
    import torch

    _wrap_clip(lambda self, c: torch.ones_like(c))


def automatic_at_2r():
    _wrap_clip(lambda self, c: 2 * c if self.clipping == "automatic" else c)


def drop_a_sample():
    def drop(self, c):
        c = c.clone()
        c[0] = 0.0  # the first sample of every micro-batch is left out of the sum
        return c

    _wrap_clip(drop)


def _scale_noise(factor: float, secret: bool):
    import dpzoo.privacy.optimizer as opt

    original, original_many = opt.noised_all_reduce, opt.noised_all_reduce_many

    def noised_all_reduce(p, summed, std, generator, *args, **kw):  # one parameter (an override's path)
        if (generator is None) == secret:
            std = std * factor
        return original(p, summed, std, generator, *args, **kw)

    def noised_all_reduce_many(params, summed, std, generator_for, every_rank_draws=False):  # all at once
        if (not every_rank_draws) == secret:  # the optimizer passes "seeded" as every_rank_draws
            std = std * factor
        return original_many(params, summed, std, generator_for, every_rank_draws)

    opt.noised_all_reduce, opt.noised_all_reduce_many = noised_all_reduce, noised_all_reduce_many


def norms_2_percent_low():
    from dpzoo.grad_norms.hooks import NormHooks

    original = NormHooks.per_sample_norms
    NormHooks.per_sample_norms = lambda self: 0.98 * original(self)


def one_layer_left_out():
    from dpzoo.grad_norms.hooks import NormHooks

    original = NormHooks.per_param_sq_norms

    def per_param_sq_norms(self):
        sq = dict(original(self))
        if len(sq) > 1:
            sq.pop(next(iter(sq)))  # the first parameter's share of the norm is forgotten
        return sq

    NormHooks.per_param_sq_norms = per_param_sq_norms


def audit_blind():
    """The graph audit compares nothing: a parameter used outside its module (``x @ layer.weight``,
    a tied projection) is never refused, its second use left out of the norms."""
    from dpzoo.grad_norms import audit, ghost

    audit.compare_uses = ghost.compare_uses = lambda step, params: None


def accountant_half_q():
    from dpzoo.privacy.accounting.accountant import Accountant

    original = Accountant.step
    Accountant.step = lambda self, sigma, q, steps=1: original(self, sigma, q / 2, steps)


def accountant_last_entry_only():
    import dpzoo.privacy.accounting.accountant as acc

    original = acc._epsilon
    acc._epsilon = lambda name, history, delta: original(name, history[-1:], delta)


MUTANTS = {
    "no-clipping": no_clipping,
    "automatic-at-2R": automatic_at_2r,
    "a-sample-dropped": drop_a_sample,
    "seeded-noise-x2": lambda: _scale_noise(2.0, secret=False),
    "seeded-noise-x0.5": lambda: _scale_noise(0.5, secret=False),
    "secret-noise-x2": lambda: _scale_noise(2.0, secret=True),
    "secret-noise-x0.5": lambda: _scale_noise(0.5, secret=True),
    "norms-2%-low": norms_2_percent_low,
    "one-layer-left-out": one_layer_left_out,
    "audit-blind": audit_blind,
    "accountant-q/2": accountant_half_q,
    "accountant-last-entry-only": accountant_last_entry_only,
}


def pytest_configure(config):
    """Plugin hook: install the mutant named by $DPZOO_MUTANT (none: no change)."""
    name = os.environ.get("DPZOO_MUTANT")
    if name:
        MUTANTS[name]()


def run(name: str, threads: int | None = None) -> tuple[bool, str, float]:
    """(killed, what killed it, seconds) for one mutant (``threads``: torch's, when run beside others)."""
    path = os.pathsep.join([str(ROOT / "tools"), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, DPZOO_MUTANT=name, PYTHONPATH=path)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    subset = sorted(SUBSET, key=lambda f: f != FIRST.get(name))
    cmd = [sys.executable, "-m", "pytest", *PYTEST_ARGS, *subset]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    failed = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    if proc.returncode == 1 and failed:
        return True, failed[0], seconds
    if proc.returncode == 0:
        return False, "every test passed", seconds
    why = f"pytest exited {proc.returncode}, not a test failure: {proc.stdout[-300:]}{proc.stderr[-300:]}"
    return False, why, seconds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", choices=list(MUTANTS), help="run these mutants only")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="mutants run at once (default: the CPUs)")
    args = ap.parse_args(argv)
    names = args.only or list(MUTANTS)
    survived = []
    threads = 1 if args.jobs > 1 else None  # one torch thread each: the processes share the cores
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for name, (killed, why, seconds) in zip(names, pool.map(lambda n: run(n, threads), names)):
            print(f"{'killed  ' if killed else 'SURVIVED'} {name:28s} {seconds:5.0f} s  {why}", flush=True)
            if not killed:
                survived.append(name)
    if survived:
        print(f"mutation check FAILED: {', '.join(survived)} survived the privacy tests ({' '.join(SUBSET)})")
        return 1
    print(f"mutation check passed: all {len(args.only or MUTANTS)} mutants killed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
