"""Empirical privacy audit in one training run: ``dpzoo.audit(...)`` and ``dpzoo audit``.

The method is the one-run audit of Steinke, Nasr & Jagielski, *Privacy Auditing with One (1)
Training Run*, NeurIPS 2023 (arXiv:2305.08846):

1. m canaries; each is put in the training set independently with probability 1/2
   (the randomised inclusion S ∈ {-1, +1}^m of their Algorithm 1);
2. one private training run on the real data plus the included canaries
   (:mod:`dpzoo.audit.training`, with the deliberately broken positive controls);
3. a score per canary from the trained model (:mod:`dpzoo.audit.task`); the auditor guesses
   "in" for the k+ highest scores, "out" for the k- lowest and abstains on the rest
   (Algorithm 1's guesses T ∈ {-1, 0, +1}^m, r = k+ + k- guesses; :mod:`dpzoo.audit.guesses`,
   a grid of guess counts with a Bonferroni correction);
4. v correct guesses out of r give a lower bound on ε at confidence 1 - β through the paper's
   main theorem: under (ε, δ)-DP, P[v or more correct] ≤ f(v) + 2mδ · max_i (f(v-i) - f(v)) / i
   with f(v) = P[Binomial(r, e^ε/(1+e^ε)) ≥ v] (:mod:`dpzoo.audit.bound`).

The white-box audit (``threat_model="white-box"``) scores each canary from every noisy step
(:mod:`dpzoo.audit.white_box`) and adds the Gaussian-DP estimator of Nasr et al. 2023
(:mod:`dpzoo.audit.gdp`); each estimator is tested at half the error budget and the larger bound
is reported. :func:`audit_from_scores` runs steps 3–4 on scores observed in your own training
loop (the white-box observer attached to its optimizer, as ``tests/test_audit_paths.py`` does for
the Hugging Face ``DPTrainer``).

:func:`audit` runs the four steps (:mod:`dpzoo.audit.run`) and returns an :class:`AuditResult`
(:mod:`dpzoo.audit.report`); :func:`audit_record` audits a saved model's mechanism and
:func:`record_audit` writes the result into its privacy card (:mod:`dpzoo.audit.of_record`, checked by :mod:`dpzoo.audit.recorded`). This package's job is to gather those names in one place: every
public name is imported from here (``from dpzoo.audit import AuditResult, epsilon_lower_bound``).
"""

from .bound import epsilon_lower_bound, one_run_p_value
from .gdp import gdp_epsilon, gdp_lower_bound
from .guesses import DEFAULT_GUESS_FRACTIONS
from .of_record import audit_record, record_audit
from .report import AuditResult, plot_scores
from .run import WHITE_BOX_CANARIES, audit, audit_from_scores, with_canaries
from .task import DIGITS_FEATURES as DIGITS_FEATURES  # importable from here, outside __all__ (as before)
from .task import DiracCanaryClassifier, digits_canary_task, logit_change_score, loss_score
from .task import LinearClassifier as LinearClassifier
from .training import BROKEN

__all__ = [
    "audit",
    "audit_from_scores",
    "audit_record",
    "record_audit",
    "with_canaries",
    "AuditResult",
    "one_run_p_value",
    "epsilon_lower_bound",
    "BROKEN",
    "digits_canary_task",
    "DiracCanaryClassifier",
    "logit_change_score",
    "loss_score",
    "plot_scores",
    "DEFAULT_GUESS_FRACTIONS",
    "WHITE_BOX_CANARIES",
    "gdp_lower_bound",
    "gdp_epsilon",
]
