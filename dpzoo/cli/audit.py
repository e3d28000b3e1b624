"""``dpzoo audit``: the one-run canary audit at given settings, and (``--run RUN_DIR``) the audit of
a saved model's own mechanism, written into its privacy card (:mod:`dpzoo.audit.of_record`)."""

from __future__ import annotations

import json

from ..errors import DPZooError
from .args import nonnegative_int, option, positive_float, positive_int, unit_interval
from .choices import AUDIT_CONTROLS, mode_names
from .common_options import add_accountant_option

__all__ = ["add_audit_parser"]

# the options that set the audited mechanism: --run takes them from the model's record instead
MECHANISM_OPTIONS = (
    "epsilon",
    "delta",
    "epochs",
    "broken",
    "white_box",
    "batch_size",
    "mode",
    "full_batch",
    "max_grad_norm",
    "accountant",
)


def _audit_run(args) -> int:
    """Audit the mechanism of the saved model ``args.run`` (and, with --with-controls, the 2R
    control at the same settings), print the statement's sentence and record both in its card."""
    import torch

    from ..audit import audit_record, record_audit
    from ..audit.recorded import replacing_audit
    from ..hub.load_save import run_model_directory
    from ..hub.saved_files import read_privacy_metadata

    given = [n for n, v in args.audit_defaults.items() if getattr(args, n) != v]
    if given:
        raise DPZooError(
            f"--run takes the mechanism from the model's record: drop --{given[0].replace('_', '-')} "
            "(only --canaries, --seed, --confidence, --with-controls, --out and --quiet go with it)."
        )
    directory = run_model_directory(args.run)
    with replacing_audit():  # a stale audit block is what this run replaces
        record = read_privacy_metadata(directory)
    if record is None:
        raise DPZooError(f"{args.run} holds no privacy record: only a model trained with DP has a mechanism to audit.")
    torch.set_num_threads(1)
    settings = dict(canaries=args.canaries, seed=args.seed, confidence=args.confidence, log=print)
    settings["progress"] = False if args.quiet else None
    result = audit_record(record, **settings)
    for line in result.lines():
        print(f"  {line}")
    control = audit_record(record, broken="sensitivity-2x", **settings) if args.with_controls else None
    if control is not None:
        caught = "caught" if control.exceeds else "NOT caught: this audit is too weak to vouch at these settings"
        print(
            f"  control, every clip doubled: ε ≥ {control.epsilon_lower_bound:.3f} against {control.claimed_epsilon:.3f}: {caught}"
        )
    block = record_audit(directory, result, control, seed=args.seed)
    if args.out:
        from ..runs.files import writable_dir

        out = writable_dir(args.out)
        payload = [r.to_dict() for r in (result, control) if r is not None]
        (out / "audit.json").write_text(json.dumps(payload, indent=1))
    print(f"recorded in {directory}/README.md and dpzoo_audit.json")
    if block["exceeds"]:
        return 1
    if block["max_auditable_epsilon"] <= block["claimed_epsilon"]:
        print(f"this audit could not have refuted ε = {block['claimed_epsilon']:.3g} (the most it can show is "
              f"{block['max_auditable_epsilon']:.3g}): more --canaries, or it cannot vouch at these settings")  # fmt: skip
        return 3
    return 3 if control is not None and not block["control_sensitivity_2x"]["caught"] else 0


def _cmd_audit(args) -> int:
    """``dpzoo audit``: the canary audit at the given settings, or (``--run``) of a saved model's
    mechanism. Exit 0: every bound is below its claim (with --with-controls: and both positive controls
    fired); 1: dpzoo's engine (or the --broken mechanism) has a bound above its claim;
    3: with --with-controls, a positive control did not fire (the audit is too weak to vouch)."""
    import torch

    from ..audit import WHITE_BOX_CANARIES, audit, plot_scores
    from ..runs.files import writable_dir

    if args.run is not None:
        return _audit_run(args)
    out = writable_dir(args.out) if args.out else None  # before the audit's training, not after
    torch.set_num_threads(1)  # a linear model on 64 + m inputs: threads only add overhead (and stall on a busy CPU)
    control_runs = ["no-noise", "sensitivity-2x"] if args.white_box else ["no-noise", "unclipped"]
    runs = [None, *control_runs] if args.with_controls else [args.broken]
    results = []
    m = args.canaries or (WHITE_BOX_CANARIES if args.white_box else 1000)
    for broken in runs:
        print(
            f"== {'white-box' if args.white_box else 'black-box'} audit of {broken or 'dpzoo engine'}: "
            f"{m} canaries, {args.epochs} epochs, "
            f"claimed ε = {args.epsilon} at δ = {args.delta}",
            flush=True,
        )
        r = audit(
            epsilon=args.epsilon,
            delta=args.delta,
            canaries=m,
            epochs=args.epochs,
            batch_size="full" if args.full_batch else args.batch_size,
            lr=args.lr,
            max_grad_norm=args.max_grad_norm,
            broken=broken,
            confidence=args.confidence,
            seed=args.seed,
            accountant=args.accountant,
            log=print,
            progress=False if args.quiet else None,
            threat_model="white-box" if args.white_box else "black-box",
            mode=args.mode,
        )
        for line in r.lines():
            print(f"  {line}")
        print(f"  ({r.seconds:.0f} s, test accuracy {r.test_accuracy:.3f})", flush=True)
        results.append(r)
    if any(r.claimed_epsilon >= r.max_auditable_epsilon for r in results):
        print(
            f"note: with {m} canaries this audit cannot show ε above "
            f"{results[0].max_auditable_epsilon:.2f}; use more canaries to audit a larger claim."
        )
    if out is not None:
        payload = [r.to_dict() for r in results] if args.with_controls else results[0].to_dict()
        (out / "audit.json").write_text(json.dumps(payload, indent=1))
        written = ["audit.json"]
        for r in results:
            name = f"scores-{r.broken or 'engine'}.png"
            if plot_scores(r, out / name):
                written.append(name)
        print(f"wrote {', '.join(written)} to {out}")
    if args.with_controls:
        engine, controls = results[0], results[1:]
        if engine.exceeds:
            return 1
        if not all(c.exceeds for c in controls):
            print(
                "A POSITIVE CONTROL DID NOT FIRE: this audit is too weak to vouch for the engine "
                "(more canaries or epochs, or a smaller claimed ε)."
            )
            return 3
        print("the engine's bound is below its claim and both positive controls fired")
        return 0
    return 1 if results[0].exceeds else 0


def add_audit_parser(sub) -> None:
    s = sub.add_parser(
        "audit",
        help="empirical privacy audit in one training run (Steinke et al. 2023)",
        description="Train once with canaries and report an empirical lower bound on ε beside the claimed ε.",
    )
    option(s, "--epsilon", type=positive_float, default=2.0, help="the claimed ε the engine is calibrated to")
    option(s, "--delta", type=unit_interval, default=1e-5, help="δ of the claim")
    option(
        s,
        "--canaries",
        type=positive_int,
        default=None,
        help="m: each is in the training set with probability 1/2 (default 1000; 2500 with --white-box)",
    )
    option(s, "--epochs", type=positive_int, default=10, help="passes over the data")
    g = s.add_mutually_exclusive_group()
    option(
        g,
        "--broken",
        choices=AUDIT_CONTROLS,
        default=None,
        help="audit a deliberately broken mechanism instead (a positive control); default: dpzoo's engine",
    )
    option(
        g,
        "--with-controls",
        kind="flag",
        help="audit dpzoo's engine and two positive controls (exit 3 if a control does not fire)",
    )
    option(
        s,
        "--white-box",
        kind="flag",
        help="observe every noisy step of the canaries' own coordinates (DP-SGD's threat model; stronger than "
        "the default black-box audit of the final model); controls: no-noise, sensitivity-2x",
    )
    option(s, "--batch-size", type=positive_int, default=64, help="expected Poisson batch size")
    option(
        s,
        "--mode",
        default="auto",
        choices=mode_names(),
        help="the engine's training mode audited (bitfit: the canaries are biases; lora: a PEFT LoRA adapter)",
    )
    option(
        s,
        "--full-batch",
        kind="flag",
        help="every step trains on the whole training set (q = 1, --epochs steps): with --white-box, the setting "
        "whose bound comes closest to the claim (docs/RESULTS.md); default: Poisson batches of --batch-size",
    )
    _add_run_options(s)
    s.set_defaults(fn=_cmd_audit, audit_defaults={n: s.get_default(n) for n in MECHANISM_OPTIONS})


def _add_run_options(s) -> None:
    """The audit's optimizer, bound, accountant, seed and output (``--run``: a saved model's)."""
    option(s, "--lr", type=positive_float, default=2.0, help="SGD's learning rate")
    option(s, "--max-grad-norm", type=positive_float, default=1.0, help="the clipping bound R")
    option(s, "--confidence", type=unit_interval, default=0.95, help="confidence of the lower bound")
    add_accountant_option(s)
    option(
        s,
        "--seed",
        type=nonnegative_int,
        default=0,
        help="fixes the canaries, their inclusion and the initialisation (the engine's noise stays secret)",
    )
    option(
        s,
        "--out",
        default=None,
        help="directory for audit.json (and score histograms with matplotlib); default: nothing written",
    )
    option(s, "--quiet", kind="flag", help="no progress bar (default: one, on a terminal)")
    option(
        s,
        "--run",
        default=None,
        help="a saved private model (a `dpzoo train --out` run or a dpzoo.save directory): audit its mechanism "
        "(σ, q, steps, R, clipping from its record) white-box and write the result into its card; default: none",
    )
