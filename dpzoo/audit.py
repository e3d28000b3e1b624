"""Empirical privacy audit in one training run: ``dpzoo.audit(...)`` and ``dpzoo audit``.

The method is the one-run audit of Steinke, Nasr & Jagielski, *Privacy Auditing with One (1)
Training Run*, NeurIPS 2023 (arXiv:2305.08846):

1. m canaries; each is put in the training set independently with probability 1/2
   (the randomised inclusion S ∈ {-1, +1}^m of their Algorithm 1);
2. one private training run on the real data plus the included canaries;
3. a score per canary from the trained model; the auditor guesses "in" for the k+ highest
   scores, "out" for the k- lowest and abstains on the rest (Algorithm 1's guesses
   T ∈ {-1, 0, +1}^m, r = k+ + k- guesses);
4. v correct guesses out of r give a lower bound on ε at confidence 1 - β through the paper's
   main theorem: under (ε, δ)-DP, P[v or more correct] ≤ f(v) + 2mδ · max_i (f(v-i) - f(v)) / i
   with f(v) = P[Binomial(r, e^ε/(1+e^ε)) ≥ v]. The bound is the largest ε that this rules out
   at level β (:func:`epsilon_lower_bound`). Binomial tails are computed exactly in log space
   here (no scipy); the implementation reproduces the worked values reported for the paper's
   reference code (tests/test_audit.py).

Choosing k after looking at the scores is a choice among several tests: dpzoo tries a fixed
grid of guess counts and applies a Bonferroni correction (each is tested at β / grid size), so
the reported confidence holds for the best of them.

**Built-in default** (no download; a few seconds of training on 2 CPU cores): scikit-learn's digits as
64-d vectors, extended by m coordinates; canary i is the vector with value ``canary_norm`` on
coordinate 64 + i and zeros elsewhere ("Dirac" canary), with a random label. Only canary i
ever touches its coordinate, so the change of the model's output at the canary, relative to
the all-zero input, isolates what training did because of that canary (score: the change of
its label's logit minus the mean change of the other logits). Without noise an out canary
scores exactly 0 and an in canary (if Poisson sampling drew it at least once) above 0; with
DP noise the scores are noise-dominated. The model is a linear classifier
(one ``nn.Linear``, which dpzoo's hooks cover) whose canary columns start at zero.

**Positive controls** (``broken=``), built here, never by the engine:

* ``"no-noise"``: the engine runs with ``noise_multiplier=0`` while the claimed ε is the one of
  the σ the engine would have calibrated for the target ε (dp-accounting, the same steps);
* ``"unclipped"``: a second copy of the model, added to the first one's output, is trained
  by a plain torch SGD optimizer outside the engine: DP-SGD's update with the engine's noise
  (same σ, R, expected batch size) but without clipping; the claimed ε is the engine's report.
  Large-norm canaries (``canary_norm``) make that unclipped gradient dwarf the noise.

Both must end with a bound above the claim; dpzoo's engine must not (with probability ≥ 1 - β).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import ConcatDataset, DataLoader, Dataset, TensorDataset

from .errors import DPZooError

__all__ = [
    "audit",
    "AuditResult",
    "one_run_p_value",
    "epsilon_lower_bound",
    "BROKEN",
    "digits_canary_task",
    "logit_change_score",
    "loss_score",
    "plot_scores",
    "DEFAULT_GUESS_FRACTIONS",
]

BROKEN = ("no-noise", "unclipped")
# total guesses r as fractions of m (balanced: k+ = ⌊r/2⌋ "in", the rest "out"); Bonferroni over these
DEFAULT_GUESS_FRACTIONS = (0.05, 0.1, 0.2, 0.4, 0.7, 0.9)
DIGITS_FEATURES = 64


# -- the bound -------------------------------------------------------------------------------------
def _binomial_pmf(r: int, epsilon: float) -> list[float]:
    """P[Binomial(r, p) = k] for k = 0..r, p = e^ε / (1 + e^ε), exact in log space."""
    log_p = -math.log1p(math.exp(-epsilon))  # log(e^ε / (1 + e^ε))
    log_q = -epsilon - math.log1p(math.exp(-epsilon))  # log(1 / (1 + e^ε))
    lg = math.lgamma(r + 1)
    return [
        math.exp(lg - math.lgamma(k + 1) - math.lgamma(r - k + 1) + k * log_p + (r - k) * log_q) for k in range(r + 1)
    ]


def one_run_p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """Upper bound, under (ε, δ)-DP, on the probability of v or more correct guesses out of r.

    Steinke, Nasr & Jagielski (2023), main theorem of the one-run audit (the (ε, δ) version):
    f(v) + 2mδ · max_{1≤i≤v} (f(v-i) - f(v)) / i with f(v) = P[Binomial(r, e^ε/(1+e^ε)) ≥ v];
    m canaries, each included with probability 1/2. Clipped to 1.
    """
    _check_counts(m, r, v)
    if not (epsilon >= 0 and math.isfinite(epsilon)):
        raise DPZooError(f"epsilon must be finite and >= 0, got {epsilon}.")
    if not 0 <= delta < 1:
        raise DPZooError(f"delta must be in [0, 1), got {delta}.")
    if v == 0:
        return 1.0
    pmf = _binomial_pmf(r, epsilon)
    tail = math.fsum(pmf[v:])
    worst, below = 0.0, 0.0  # below = f(v-i) - f(v) = P[v-i ≤ B < v]
    for i in range(1, v + 1):
        below += pmf[v - i]
        worst = max(worst, below / i)
    return min(1.0, tail + 2 * m * delta * worst)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, beta: float = 0.05, tol: float = 1e-6) -> float:
    """The largest ε such that v correct guesses out of r reject (ε, δ)-DP at level β.

    The mechanism is not (ε', δ)-DP for any ε' below it, with confidence 1 - β (the one-run
    audit of Steinke, Nasr & Jagielski 2023). The p-value grows with ε, so bisection on
    :func:`one_run_p_value` finds it (to ``tol``; the lower end of the bracket is returned, so
    the bound never overstates). 0 when even ε = 0 is not rejected.
    """
    _check_counts(m, r, v)
    if not 0 < beta < 1:
        raise DPZooError(f"beta (1 - confidence) must be in (0, 1), got {beta}.")
    if one_run_p_value(m, r, v, 0.0, delta) > beta:
        return 0.0
    lo, hi = 0.0, 1.0
    while one_run_p_value(m, r, v, hi, delta) <= beta:
        lo, hi = hi, 2 * hi
        if hi > 1e4:  # not reached for finite r: the p-value tends to 1 as ε grows
            return lo
    while hi - lo > tol:
        mid = (lo + hi) / 2
        if one_run_p_value(m, r, v, mid, delta) <= beta:
            lo = mid
        else:
            hi = mid
    return lo


def _check_counts(m, r, v):
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (m, r, v)):
        raise DPZooError(f"m, r, v must be integers, got m={m!r}, r={r!r}, v={v!r}.")
    if not 0 <= v <= r <= m or m < 1:
        raise DPZooError(f"need 0 <= v (correct) <= r (guesses) <= m (canaries) and m >= 1, got v={v}, r={r}, m={m}.")


# -- guesses ----------------------------------------------------------------------------------------
def _guess_counts(m: int, fractions: Sequence[float]) -> list[tuple[int, int]]:
    out = []
    for f in fractions:
        r = max(2, min(m, round(f * m)))
        pair = (r // 2, r - r // 2)
        if pair not in out:
            out.append(pair)
    return out


def _score_guesses(
    scores: torch.Tensor, included: torch.Tensor, k_plus: int, k_minus: int, generator: torch.Generator
) -> int:
    """Correct guesses when the k+ highest scores are guessed in and the k- lowest out (ties
    broken at random: a random permutation, then a stable sort)."""
    perm = torch.randperm(len(scores), generator=generator)
    order = perm[torch.sort(scores[perm], descending=True, stable=True).indices]
    guessed_in, guessed_out = order[:k_plus], order[len(order) - k_minus :]
    return int(included[guessed_in].sum()) + int((~included[guessed_out]).sum())


# -- the result -------------------------------------------------------------------------------------
@dataclass
class AuditResult:
    """What one audit measured. ``exceeds`` is True when the bound is above the claimed ε."""

    claimed_epsilon: float  # what the mechanism claims, at ``delta``
    delta: float
    epsilon_lower_bound: float  # empirical lower bound at ``confidence``
    confidence: float  # 1 - β, for the best of the tried guess counts (Bonferroni)
    canaries: int  # m
    guesses: int  # r = k_plus + k_minus of the best guess count
    correct: int  # v
    k_plus: int
    k_minus: int
    included: int  # canaries that were in the training set
    broken: str | None  # None: dpzoo's engine as is
    max_auditable_epsilon: float  # the bound if every guess were right: claims above it cannot be refuted
    mechanism: dict = field(default_factory=dict)  # σ, R, q, steps, epochs, lr, ...
    candidates: list = field(default_factory=list)  # every (k+, k-, v, bound) tried
    test_accuracy: float | None = None
    seconds: float = 0.0
    scores: list = field(default_factory=list, repr=False)
    membership: list = field(default_factory=list, repr=False)

    @property
    def exceeds(self) -> bool:
        return self.epsilon_lower_bound > self.claimed_epsilon

    @property
    def verdict(self) -> str:
        if self.exceeds:
            return "BOUND EXCEEDS CLAIM: the mechanism is not as private as claimed"
        return "bound below claim: consistent"

    def to_dict(self, scores: bool = True) -> dict:
        d = asdict(self)
        if not scores:
            d.pop("scores"), d.pop("membership")
        d["exceeds"], d["verdict"] = self.exceeds, self.verdict
        d["claimed_epsilon"] = self.claimed_epsilon if math.isfinite(self.claimed_epsilon) else None
        return d

    def lines(self) -> list[str]:
        mech = self.broken or "dpzoo engine"
        sigma = self.mechanism.get("noise_multiplier", float("nan"))
        claimed_sigma = self.mechanism.get("claimed_noise_multiplier", sigma)
        sigma_text = f"{sigma:.3g}" if sigma == claimed_sigma else f"{sigma:.3g} while claiming {claimed_sigma:.3g}"
        return [
            f"mechanism: {mech} (σ = {sigma_text}, "
            f"R = {self.mechanism.get('max_grad_norm')}, q = {self.mechanism.get('sample_rate', 0):.4f}, "
            f"{self.mechanism.get('steps')} steps)",
            f"claimed ε = {self.claimed_epsilon:.3f} at δ = {self.delta:g}",
            f"empirical lower bound ε ≥ {self.epsilon_lower_bound:.3f} at {100 * self.confidence:g}% confidence "
            f"(m = {self.canaries} canaries, {self.included} in; r = {self.guesses} guesses, "
            f"v = {self.correct} correct; most this audit can show: {self.max_auditable_epsilon:.2f})",
            self.verdict,
        ]


# -- the built-in task ------------------------------------------------------------------------------
class LinearClassifier(nn.Module):
    """A linear classifier; the audit zeroes the weight columns of the canary coordinates."""

    def __init__(self, in_features: int, num_classes: int = 10):
        super().__init__()
        self.fc = nn.Linear(in_features, num_classes)

    def forward(self, x):
        return self.fc(x)


def digits_canary_task(canaries: int, canary_norm: float = 1000.0, seed: int = 0, test_fraction: float = 0.2):
    """The built-in audit task: (train, test, canary_x, canary_y, model_fn, score_fn).

    scikit-learn's digits as 64-d vectors in [0, 1], extended with ``canaries`` zero coordinates;
    canary i is ``canary_norm`` times the unit vector on coordinate 64 + i, with a random label.
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise DPZooError("the built-in audit uses scikit-learn's digits: pip install scikit-learn") from None
    data = load_digits()
    g = torch.Generator().manual_seed(seed)
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=g)
    n_test = int(len(y) * test_fraction)
    d = DIGITS_FEATURES + canaries
    x = torch.cat([x, torch.zeros(len(y), canaries)], 1)
    test, train = perm[:n_test], perm[n_test:]
    canary_x = torch.zeros(canaries, d)
    canary_x[torch.arange(canaries), DIGITS_FEATURES + torch.arange(canaries)] = canary_norm
    canary_y = torch.randint(0, 10, (canaries,), generator=g)

    def model_fn():
        model = LinearClassifier(d, 10)
        with torch.no_grad():
            model.fc.weight[:, DIGITS_FEATURES:] = 0  # canary coordinates start at zero
        return model

    return (
        TensorDataset(x[train], y[train]),
        TensorDataset(x[test], y[test]),
        canary_x,
        canary_y,
        model_fn,
        logit_change_score,
    )


def logit_change_score(model: nn.Module, canary_x: torch.Tensor, canary_y: torch.Tensor) -> torch.Tensor:
    """Score of a "Dirac" canary: how much more the model's output at the canary favours its
    label than its output at the all-zero input does (the label's logit minus the mean of the
    others). Only canary i reaches its coordinate, so this is what training did because of it."""
    with torch.no_grad():
        out = model(canary_x) - model(torch.zeros_like(canary_x[:1]))
        k = out.shape[1]
        own = out.gather(1, canary_y[:, None]).squeeze(1)
        return own - (out.sum(1) - own) / (k - 1)


def loss_score(model: nn.Module, canary_x: torch.Tensor, canary_y: torch.Tensor) -> torch.Tensor:
    """Black-box score: minus the canary's cross-entropy loss (higher: more likely trained on)."""
    with torch.no_grad():
        return -F.cross_entropy(model(canary_x), canary_y, reduction="none")


class _OutsideEngine(nn.Module):
    """The "unclipped" bug: ``side``'s output is added to the engine's model, and ``side`` is
    trained by a plain optimizer on raw gradients (no clipping, no noise)."""

    def __init__(self, private: nn.Module, side: nn.Module):
        super().__init__()
        self.private, self.side = private, side

    def forward(self, x):
        return self.private(x) + self.side(x)


# -- the audit --------------------------------------------------------------------------------------
def audit(
    *,
    epsilon: float = 2.0,
    delta: float = 1e-5,
    canaries: "int | tuple[torch.Tensor, torch.Tensor]" = 1000,
    epochs: int = 10,
    batch_size: int = 64,
    lr: float = 2.0,
    max_grad_norm: float = 1.0,
    clipping: str = "abadi",
    broken: str | None = None,
    confidence: float = 0.95,
    seed: int = 0,
    accountant: str = "rdp",
    canary_norm: float = 1000.0,
    dataset: Dataset | None = None,
    model_fn: Callable[[], nn.Module] | None = None,
    score_fn: Callable | None = None,
    loss_fn: Callable | None = None,
    test_dataset: Dataset | None = None,
    guess_fractions: Sequence[float] = DEFAULT_GUESS_FRACTIONS,
    noise_seed: int | None = None,
    sample_seed: int | None = None,
    log: Callable[[str], None] | None = None,
) -> AuditResult:
    """Insert canaries, train once with dpzoo's engine, return the empirical lower bound on ε.

    Built-in default (``dataset=None``): digits with ``canaries`` (an int, m) Dirac canaries of
    norm ``canary_norm``, a linear classifier, :func:`logit_change_score`.

    General path: ``dataset`` (items ``(x, y)``), ``model_fn()`` (a fresh model whose trainable
    parameters dpzoo's engine covers), ``canaries=(canary_x, canary_y)`` (m canaries, each put
    in the training set with probability 1/2), ``score_fn(model, canary_x, canary_y)`` (higher:
    more likely in; default :func:`loss_score`), ``loss_fn(output, y)`` (a batch mean; default
    cross-entropy; a custom loss needs a ``score_fn``), optional ``test_dataset`` for accuracy.

    Training is the engine's public API: Poisson batches of expected size ``batch_size``, SGD
    at ``lr``, ``target_epsilon=epsilon`` at ``delta`` over ``epochs``, Abadi clipping at
    ``max_grad_norm``. ``broken="no-noise"`` / ``"unclipped"``: the positive controls (module
    docstring). ``seed`` fixes the canaries, their inclusion, the model's initialisation and the
    tie-breaking (through torch's generator, isolated by ``torch.random.fork_rng``); the
    engine's noise and Poisson sampling are its own (secret) unless ``noise_seed`` /
    ``sample_seed`` are passed on to ``make_private`` (tests only). Returns an
    :class:`AuditResult`; ``result.exceeds`` is True when the bound is above the claimed ε.

    Which guess counts to use is chosen after scoring, among ``guess_fractions`` of m (total
    guesses r, split evenly in / out), each tested at (1 - confidence) / len(guess_fractions).
    """
    _validate(epsilon, delta, epochs, batch_size, lr, max_grad_norm, broken, confidence, guess_fractions)
    log = log or (lambda s: None)
    t0 = time.time()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if dataset is None:
            if not isinstance(canaries, int) or isinstance(canaries, bool) or canaries < 2:
                raise DPZooError(f"canaries must be an integer >= 2 for the built-in audit, got {canaries!r}.")
            if not canary_norm > 0:
                raise DPZooError(f"canary_norm must be > 0, got {canary_norm}.")
            train, test, cx, cy, default_model_fn, default_score = digits_canary_task(canaries, canary_norm, seed)
            model_fn = model_fn or default_model_fn
            score_fn = score_fn or default_score
            test_dataset = test if test_dataset is None else test_dataset
        else:
            if model_fn is None:
                raise DPZooError("audit(dataset=...) needs model_fn=: a function returning a fresh model.")
            if not (isinstance(canaries, (tuple, list)) and len(canaries) == 2):
                raise DPZooError(
                    "audit(dataset=...) needs canaries=(canary_x, canary_y): the m canary inputs "
                    "and labels (an integer count is only for the built-in digits audit)."
                )
            cx, cy = canaries
            if len(cx) != len(cy) or len(cx) < 2:
                raise DPZooError(
                    f"canaries: need as many labels as inputs and at least 2 canaries, got "
                    f"{len(cx)} inputs and {len(cy)} labels."
                )
            if loss_fn is not None and score_fn is None:
                raise DPZooError(
                    "a custom loss_fn needs a score_fn (the default score is minus the "
                    "cross-entropy loss of each canary)."
                )
            score_fn = score_fn or loss_score
            train = dataset
        loss_fn = loss_fn or F.cross_entropy
        m = len(cx)
        g = torch.Generator().manual_seed(seed + 1)
        included = torch.rand(m, generator=g) < 0.5  # Algorithm 1: each canary in w.p. 1/2
        train_set = ConcatDataset([train, TensorDataset(cx[included], cy[included])])
        model, claimed, mech = _train(
            train_set,
            model_fn,
            loss_fn,
            epsilon=epsilon,
            delta=delta,
            epochs=epochs,
            batch_size=batch_size,
            lr=lr,
            max_grad_norm=max_grad_norm,
            clipping=clipping,
            broken=broken,
            accountant=accountant,
            noise_seed=noise_seed,
            sample_seed=sample_seed,
            log=log,
        )
        model.eval()
        scores = score_fn(model, cx, cy).detach().float().flatten()
        if scores.shape[0] != m or not torch.isfinite(scores).all():
            raise DPZooError(
                f"score_fn must return {m} finite scores (one per canary), got shape "
                f"{tuple(scores.shape)}{'' if torch.isfinite(scores).all() else ' with non-finite values'}."
            )
        accuracy = _accuracy(model, test_dataset) if test_dataset is not None else None
    beta = 1 - confidence
    counts = _guess_counts(m, guess_fractions)
    level = beta / len(counts)  # Bonferroni over the tried guess counts
    tie = torch.Generator().manual_seed(seed + 2)
    candidates = []
    for k_plus, k_minus in counts:
        v = _score_guesses(scores, included, k_plus, k_minus, tie)
        candidates.append(
            {
                "k_plus": k_plus,
                "k_minus": k_minus,
                "correct": v,
                "epsilon_lower_bound": epsilon_lower_bound(m, k_plus + k_minus, v, delta, level),
            }
        )
    # the strongest bound; among equal ones (e.g. all 0) the most guesses, the most informative line
    best = max(candidates, key=lambda c: (c["epsilon_lower_bound"], c["k_plus"] + c["k_minus"]))
    return AuditResult(
        claimed_epsilon=claimed,
        delta=delta,
        epsilon_lower_bound=best["epsilon_lower_bound"],
        confidence=confidence,
        canaries=m,
        guesses=best["k_plus"] + best["k_minus"],
        correct=best["correct"],
        k_plus=best["k_plus"],
        k_minus=best["k_minus"],
        included=int(included.sum()),
        broken=broken,
        max_auditable_epsilon=max(epsilon_lower_bound(m, a + b, a + b, delta, level) for a, b in counts),
        mechanism=mech,
        candidates=candidates,
        test_accuracy=accuracy,
        seconds=time.time() - t0,
        scores=scores.tolist(),
        membership=included.tolist(),
    )


def _train(
    train_set,
    model_fn,
    loss_fn,
    *,
    epsilon,
    delta,
    epochs,
    batch_size,
    lr,
    max_grad_norm,
    clipping,
    broken,
    accountant,
    noise_seed,
    sample_seed,
    log,
):
    """One private training run with dpzoo's engine (or a deliberately broken variant).

    Returns (released model, claimed ε at δ, mechanism settings)."""
    from .privacy import Accountant, PrivacyEngine, get_noise_multiplier

    model = model_fn().train()
    side = side_opt = None
    if broken == "unclipped":
        side = model_fn().train()
        side_opt = torch.optim.SGD(side.parameters(), lr=lr)  # outside the engine: noised but unclipped
    engine = PrivacyEngine(accountant=accountant)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    noise = dict(noise_multiplier=0.0) if broken == "no-noise" else dict(target_epsilon=epsilon)
    seeds = {k: v for k, v in (("noise_seed", noise_seed), ("sample_seed", sample_seed)) if v is not None}
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(train_set, batch_size=batch_size),
        target_delta=delta,
        epochs=epochs,
        max_grad_norm=max_grad_norm,
        clipping=clipping,
        mode="auto",
        **noise,
        **seeds,
    )
    q = batch_size / len(train_set)
    intended = (
        get_noise_multiplier(epsilon, delta, q, epochs * len(loader), accountant)
        if broken == "no-noise"
        else engine.noise_multiplier
    )
    released = _OutsideEngine(model, side) if side is not None else model
    log(
        f"training: {len(train_set)} examples, q = {q:.4f}, σ = {engine.noise_multiplier:.3f}"
        f"{f' (claimed: {intended:.3f})' if broken == 'no-noise' else ''}, {epochs} epochs"
        f"{', plus a copy trained outside the engine' if side is not None else ''}"
    )
    steps = 0
    for _ in range(epochs):
        for x, y in loader:
            if len(y):  # an empty Poisson batch: no backward, the optimizer still adds noise and counts the step
                loss_fn(released(x), y).backward()
            opt.step()
            opt.zero_grad()
            if side_opt is not None:
                _noisy_unclipped_step(side, side_opt, len(y), engine.noise_multiplier * max_grad_norm, batch_size)
            steps += 1
    engine.detach()
    steps = int(getattr(engine, "steps", steps))  # the accountant's count (it includes any step the engine took itself)
    if broken == "no-noise":
        acc = Accountant(accountant)
        acc.step(intended, q, steps)
        claimed = acc.get_epsilon(delta)
    else:
        claimed = engine.get_epsilon(delta)
    mech = {
        "noise_multiplier": float(engine.noise_multiplier),
        "claimed_noise_multiplier": float(intended),
        "max_grad_norm": max_grad_norm,
        "clipping": clipping,
        "sample_rate": q,
        "steps": steps,
        "epochs": epochs,
        "batch_size": batch_size,
        "lr": lr,
        "accountant": accountant,
        "optimizer": "SGD",
        "outside_engine": (
            "a model copy trained by plain SGD on noised, unclipped gradients" if side is not None else None
        ),
    }
    return released, claimed, mech


def _noisy_unclipped_step(
    side: nn.Module, opt: torch.optim.Optimizer, batch: int, std: float, expected_batch: float
) -> None:
    """The "unclipped" bug: DP-SGD's update without the clipping. The sum of the raw per-sample
    gradients (``batch`` times the mean-loss gradient) plus the engine's noise N(0, σ²R²),
    divided by the expected batch size as the engine does, then a plain optimizer step."""
    with torch.no_grad():
        for p in side.parameters():
            total = p.grad * batch if p.grad is not None else torch.zeros_like(p)
            p.grad = (total + std * torch.randn_like(p)) / expected_batch
    opt.step()
    opt.zero_grad()


def plot_scores(result: AuditResult, path) -> bool:
    """Histogram of the in / out canaries' scores to ``path`` (PNG). False without matplotlib."""
    try:
        from matplotlib.figure import Figure  # no pyplot: leaves the user's backend alone
    except ImportError:
        return False
    scores, member = torch.tensor(result.scores), torch.tensor(result.membership, dtype=torch.bool)
    fig = Figure(figsize=(6, 3.5))
    ax = fig.subplots()
    bins = torch.linspace(float(scores.min()), float(scores.max()) + 1e-9, 41).tolist()
    ax.hist(scores[member].tolist(), bins=bins, alpha=0.6, label=f"in ({int(member.sum())})")
    ax.hist(scores[~member].tolist(), bins=bins, alpha=0.6, label=f"out ({int((~member).sum())})")
    ax.set_xlabel("canary score")
    ax.set_ylabel("canaries")
    ax.set_title(
        f"{result.broken or 'dpzoo engine'}: claimed ε = {result.claimed_epsilon:.2f}, "
        f"ε ≥ {result.epsilon_lower_bound:.2f} ({100 * result.confidence:g}%)",
        fontsize=9,
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def _accuracy(model, dataset) -> float:
    correct = 0
    with torch.no_grad():
        for x, y in DataLoader(dataset, batch_size=512):
            correct += int((model(x).argmax(1) == y).sum())
    return correct / len(dataset)


def _validate(epsilon, delta, epochs, batch_size, lr, max_grad_norm, broken, confidence, guess_fractions):
    if not (isinstance(epsilon, (int, float)) and 0 < epsilon < math.inf):
        raise DPZooError(f"epsilon must be a finite number > 0 (the claimed ε), got {epsilon!r}.")
    if not (isinstance(delta, (int, float)) and 0 < delta < 1):
        raise DPZooError(f"delta must be in (0, 1), e.g. 1e-5, got {delta!r}.")
    if not (isinstance(epochs, int) and epochs >= 1):
        raise DPZooError(f"epochs must be an integer >= 1, got {epochs!r}.")
    if not (isinstance(batch_size, int) and batch_size >= 1):
        raise DPZooError(f"batch_size must be an integer >= 1, got {batch_size!r}.")
    if not lr > 0:
        raise DPZooError(f"lr must be > 0, got {lr!r}.")
    if not max_grad_norm > 0:
        raise DPZooError(f"max_grad_norm must be > 0, got {max_grad_norm!r}.")
    if broken is not None and broken not in BROKEN:
        raise DPZooError(f"broken must be None, 'no-noise' or 'unclipped', got {broken!r}.")
    if not 0 < confidence < 1:
        raise DPZooError(f"confidence must be in (0, 1), e.g. 0.95, got {confidence!r}.")
    if not guess_fractions or not all(0 < f <= 1 for f in guess_fractions):
        raise DPZooError(f"guess_fractions must be fractions of the canaries in (0, 1], got {guess_fractions!r}.")
