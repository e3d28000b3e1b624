"""How close can the white-box audit come to its claim? Its estimators run on scores simulated from
the *claimed* mechanism itself, so no implementation can do better than what this prints.

Two simulations, each over several seeds and canary counts:

- ``mechanism``: the built-in white-box audit's Poisson-subsampled Gaussian (its σ, q and steps,
  read from a white-box result file of ``benchmarks/audit_sweep.py``). Each canary is in with
  probability 1/2; an in-canary adds exactly R to its isolated coordinate at each step Poisson
  sampling draws it (the strongest canary the claim allows), every coordinate gets N(0, σ²R²).
  The score is the audit's log-likelihood ratio (``dpzoo/audit/white_box.py``).
- ``gdp-pair``: scores N(μ, 1) for in-canaries and N(0, 1) for out, with μ the μ-GDP that
  gives exactly the claimed ε at δ: the estimators' best case when the trade-off curve is Gaussian.

Both estimators are dpzoo's own, at the audit's confidences (each at 97.5%, so the larger bound
holds at 95%): the one-run bound (Steinke, Nasr & Jagielski 2023) over the default guess grid,
and the Gaussian-DP bound (Nasr et al. 2023).

    python benchmarks/audit_ceiling.py --out benchmarks/results/audit/ceiling_eps2.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from scipy import optimize

from dpzoo.audit import DEFAULT_GUESS_FRACTIONS
from dpzoo.audit.gdp import gdp_epsilon, gdp_lower_bound
from dpzoo.audit.guesses import best_guesses
from dpzoo.privacy.accounting.accountant import Accountant, get_noise_multiplier

EACH = 0.975  # each estimator's confidence in the white-box audit


def mechanism_scores(m: int, sigma: float, q: float, steps: int, g: torch.Generator):
    included = torch.rand(m, generator=g) < 0.5
    scores = torch.zeros(m, dtype=torch.float64)
    for _ in range(steps):
        drawn = included & (torch.rand(m, generator=g) < q)
        z = drawn.double() + sigma * torch.randn(m, generator=g, dtype=torch.float64)
        log_in = math.log(q) + (z - 0.5) / sigma**2
        scores += log_in if q == 1 else torch.logaddexp(torch.full_like(log_in, math.log1p(-q)), log_in)
    return scores, included


def gdp_pair_scores(m: int, mu: float, g: torch.Generator):
    included = torch.rand(m, generator=g) < 0.5
    return torch.randn(m, generator=g, dtype=torch.float64) + mu * included.double(), included


def bounds(scores, included, delta: float, seed: int) -> dict:
    tie = torch.Generator().manual_seed(seed)
    _, best, _ = best_guesses(scores.float(), included, delta, EACH, DEFAULT_GUESS_FRACTIONS, tie)
    gdp = gdp_lower_bound(scores, included, delta, EACH)
    return {"one-run": best["epsilon_lower_bound"], "gdp": gdp["epsilon_lower_bound"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mechanism-from", default="benchmarks/results/audit/white_box_eps2.json")
    ap.add_argument("--canaries", type=int, nargs="+", default=[1000, 2500, 10000])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--sample-rate", type=float, help="a hypothetical mechanism instead: q (with --steps, --epsilon)")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--epsilon", type=float, help="the claim σ is calibrated to (RDP, as the audit), with --delta")
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--out", default="benchmarks/results/audit/ceiling_eps2.json")
    args = ap.parse_args(argv)
    if args.sample_rate is None:
        run = next(r for r in json.loads(Path(args.mechanism_from).read_text())["runs"] if r["broken"] is None)
        mech, claim, delta = run["mechanism"], run["claimed_epsilon"], run["delta"]
        sigma, q, steps, source = mech["noise_multiplier"], mech["sample_rate"], mech["steps"], args.mechanism_from
    else:
        q, steps, delta, source = args.sample_rate, args.steps, args.delta, "hypothetical"
        sigma = get_noise_multiplier(args.epsilon, delta, q, steps, accountant="rdp")
        claim = Accountant("rdp", [(sigma, q, steps)]).get_epsilon(delta)
    mu = optimize.brentq(lambda x: gdp_epsilon(x, delta) - claim, 1e-3, 20.0)
    rows = []
    for m in args.canaries:
        for seed in range(args.seeds):
            g = torch.Generator().manual_seed(seed)
            for kind, (scores, included) in (
                ("mechanism", mechanism_scores(m, sigma, q, steps, g)),
                ("gdp-pair", gdp_pair_scores(m, mu, g)),
            ):
                rows.append({"simulation": kind, "canaries": m, "seed": seed, **bounds(scores, included, delta, seed)})
                print(rows[-1], flush=True)
    data = {
        "command": "python benchmarks/audit_ceiling.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "claimed_epsilon": claim,
        "delta": delta,
        "mechanism": {"noise_multiplier": sigma, "sample_rate": q, "steps": steps, "from": source},
        "gdp_pair_mu": mu,
        "runs": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
