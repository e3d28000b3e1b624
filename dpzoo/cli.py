"""The ``dpzoo`` command line.

dpzoo list [PATTERN]                 zoo entries
dpzoo card NAME                      the model card
dpzoo summary NAME [--set k=v ...]   parameters, bias share, norms, ties
dpzoo prepare NAME [--set k=v ...] [--weights PATH] [--out DIR]
                                     build a DP-ready model, check it, run one
                                     forward/backward on a synthetic batch, save it
dpzoo cards --write DIR              (re)write the markdown model cards
dpzoo train NAME [--data digits] [--epsilon 8] [--epochs 5] [--mode bk-mixopt|bitfit|...]
                                     private training on a built-in dataset
dpzoo audit [--epsilon 2] [--delta 1e-5] [--canaries 1000] [--epochs 10]
            [--broken no-noise|unclipped | --with-controls] [--out DIR] [--seed 0]
                                     empirical lower bound on ε in one training run (exit 1
                                     when it exceeds the claimed ε)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _parse_sets(items: list[str]) -> dict:
    out = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"dpzoo: --set expects KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw  # plain strings need no quotes: --set gn_groups=auto
    return out


def _example_batch(card, batch_size=4):
    import torch

    spec = card.example_input
    g = torch.Generator().manual_seed(0)
    if spec.get("kind") == "image":
        return (torch.randn(batch_size, *spec["shape"], generator=g),), {}
    if spec.get("kind") == "tokens":
        return (), {"input_ids": torch.randint(0, spec["vocab_size"], (batch_size, spec["seq_len"]), generator=g)}
    return None


def _cmd_list(args) -> int:
    import dpzoo

    for name in dpzoo.list_models(args.pattern):
        print(f"{name:<24} {dpzoo.model_card(name).summary}")
    return 0


def _cmd_card(args) -> int:
    import dpzoo

    print(dpzoo.model_card(args.name).to_markdown(), end="")
    return 0


def _build(args):
    import dpzoo

    overrides = _parse_sets(args.set)
    if getattr(args, "small", False):
        overrides = {**dpzoo.model_card(args.name).test_overrides, **overrides}
    if getattr(args, "meta", False):
        import torch

        with torch.device("meta"):
            return dpzoo.load(args.name, **overrides)
    return dpzoo.load(args.name, weights=getattr(args, "weights", None), **overrides)


def _cmd_summary(args) -> int:
    import dpzoo

    model = _build(args)
    print(dpzoo.summary(model))
    return 0


def _cmd_prepare(args) -> int:
    import torch

    import dpzoo

    card = dpzoo.model_card(args.name)
    model = _build(args)
    report = model.dpzoo_patch_report
    print(f"{args.name}: DP-ready")
    for line in report.lines() or ["no patches needed"]:
        print(f"  - {line}")
    problems = dpzoo.check_dp_ready(model, bias_exempt=card.bias_exempt)
    for p in problems:
        print(f"  ! {p}")
    print(dpzoo.summary(model))
    batch = _example_batch(card)
    if batch is not None and not args.small:
        print("(synthetic batch skipped: it matches the small configuration; pass --small)")
    elif batch is not None:
        model.train()
        out = model(*batch[0], **batch[1])
        out = out if isinstance(out, torch.Tensor) else out.logits
        out.float().pow(2).mean().backward()
        print(f"forward/backward on a synthetic batch: output {list(out.shape)}, ok")
    if args.out:
        path = dpzoo.save(model, args.out)
        print(f"saved to {path}")
    return 1 if problems else 0


def _cmd_cards(args) -> int:
    import dpzoo

    out = Path(args.write)
    out.mkdir(parents=True, exist_ok=True)
    for name in dpzoo.list_models():
        (out / f"{name}.md").write_text(dpzoo.model_card(name).to_markdown())
    print(f"wrote {len(dpzoo.list_models())} cards to {out}")
    return 0


def _cmd_train(args) -> int:
    import dpzoo

    if dpzoo.model_card(args.name).task == "sequential-recommendation":
        from .seqrec.train import train_seqrec

        train_seqrec(
            args.name,
            data=args.data if args.data != "digits" else "synthetic",
            epsilon=args.epsilon,
            delta=args.delta,
            epochs=args.epochs,
            batch_size=args.batch_size,
            lr=args.lr,
            max_len=args.max_len,
            max_grad_norm=args.max_grad_norm,
            clipping=args.clipping,
            eval_every=args.eval_every,
            accountant=args.accountant,
            seed=args.seed,
            out=args.out,
            overrides=_parse_sets(args.set),
            max_physical_batch_size=args.max_physical_batch_size,
            device=args.device,
            private=not args.non_private,
            amazon_columns=args.amazon_columns,
        )
        return 0
    if args.non_private:
        raise dpzoo.DPZooError("--non-private is for sequence models; image models train privately only.")
    from .train import train_image_classifier

    train_image_classifier(
        args.name,
        data=args.data,
        epsilon=args.epsilon,
        delta=args.delta if args.delta is not None else 1e-5,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        mode=args.mode,
        clipping=args.clipping,
        max_grad_norm=args.max_grad_norm,
        out=args.out,
        small=not args.full_size,
        accountant=args.accountant,
        overrides=_parse_sets(args.set),
        seed=args.seed,
    )
    return 0


def _cmd_audit(args) -> int:
    """Exit 0: every bound is below its claim (with --with-controls: and both positive controls
    fired); 1: dpzoo's engine (or the --broken mechanism) has a bound above its claim;
    3: with --with-controls, a positive control did not fire (the audit is too weak to vouch)."""
    import torch

    from .audit import audit, plot_scores

    torch.set_num_threads(1)  # a linear model on 64 + m inputs: threads only add overhead (and stall on a busy CPU)
    runs = [None, "no-noise", "unclipped"] if args.with_controls else [args.broken]
    results = []
    for broken in runs:
        print(
            f"== audit of {broken or 'dpzoo engine'}: {args.canaries} canaries, {args.epochs} epochs, "
            f"claimed ε = {args.epsilon} at δ = {args.delta}"
        )
        r = audit(
            epsilon=args.epsilon,
            delta=args.delta,
            canaries=args.canaries,
            epochs=args.epochs,
            batch_size=args.batch_size,
            lr=args.lr,
            max_grad_norm=args.max_grad_norm,
            broken=broken,
            confidence=args.confidence,
            seed=args.seed,
            accountant=args.accountant,
            log=print,
        )
        for line in r.lines():
            print(f"  {line}")
        print(f"  ({r.seconds:.0f} s, test accuracy {r.test_accuracy:.3f})")
        results.append(r)
    if any(r.claimed_epsilon >= r.max_auditable_epsilon for r in results):
        print(
            f"note: with {args.canaries} canaries this audit cannot show ε above "
            f"{results[0].max_auditable_epsilon:.2f}; use more canaries to audit a larger claim."
        )
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
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


def _registries():
    """Choices of ``--accountant``, ``--mode`` and ``--data``, read from the registries when the
    parser is built (so what a user registered before calling :func:`main` is offered)."""
    from .privacy.accountant import ACCOUNTANTS, accountant_spec
    from .privacy.modes import TRAINING_MODES
    from .seqrec.downloads import DATASETS

    # the engine refuses accountants that are not upper bounds (e.g. "gdp"): not offered
    usable = [name for name in ACCOUNTANTS if accountant_spec(name).upper_bound]
    modes = "; ".join(f"{m.name}: {m.description}" for m in TRAINING_MODES.values())
    data = ", ".join(f"{d.name} ({d.description})" if d.description else d.name for d in DATASETS.values())
    max_len = ", ".join(f"{d.name}: {d.max_len}" for d in DATASETS.values() if d.max_len != 50)  # the specs' defaults
    return usable, list(TRAINING_MODES), modes, data, max_len


def build_parser() -> argparse.ArgumentParser:
    from .privacy.modes import DEFAULT_CLI_MODE

    accountants, mode_names, modes_help, data_help, max_len_help = _registries()
    p = argparse.ArgumentParser(prog="dpzoo", description="A zoo of differentially-private-ready models.")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("list", help="list zoo entries")
    s.add_argument("pattern", nargs="?", default="*")
    s.set_defaults(fn=_cmd_list)
    s = sub.add_parser("card", help="print a model card")
    s.add_argument("name")
    s.set_defaults(fn=_cmd_card)
    for cmd, fn, hlp in (
        ("summary", _cmd_summary, "parameter counts, bias share, norms, ties"),
        ("prepare", _cmd_prepare, "build, check, smoke-test and save a DP-ready model"),
    ):
        s = sub.add_parser(cmd, help=hlp)
        s.add_argument("name")
        s.add_argument("--set", action="append", metavar="KEY=VALUE", help="an override (JSON value)")
        s.add_argument("--small", action="store_true", help="start from the card's small test configuration")
        if cmd == "summary":
            s.add_argument("--meta", action="store_true", help="build on the meta device (no memory, full size)")
        else:
            s.add_argument("--weights", help="a local checkpoint to convert")
            s.add_argument("--out", help="directory to save the DP-ready model to")
        s.set_defaults(fn=fn)
    s = sub.add_parser("train", help="private training of a zoo model on a built-in dataset")
    s.add_argument("name")
    s.add_argument(
        "--data",
        default="digits",
        help="image models: digits (bundled with scikit-learn); sequence models: synthetic (default), "
        f"{data_help} or a file path (dpzoo.seqrec.register_dataset adds names)",
    )
    s.add_argument(
        "--amazon-columns",
        default=None,
        choices=["user,item,rating,timestamp", "item,user,rating,timestamp"],
        help="column order of an Amazon CSV given as a path (2014 release: user first; "
        "2018: item first); default: told from the ids' shape",
    )
    s.add_argument("--epsilon", type=float, default=8.0)
    s.add_argument(
        "--delta",
        type=float,
        default=None,
        help="delta (default: 1e-5 for images, N^-1.1 for N users of sequence data)",
    )
    s.add_argument(
        "--max-len",
        type=int,
        default=None,
        help=f"sequence models: input length ({max_len_help + ', ' if max_len_help else ''}else 50)",
    )
    s.add_argument("--eval-every", type=int, default=5, help="sequence models: evaluate every k epochs")
    s.add_argument("--max-physical-batch-size", type=int, default=None)
    s.add_argument("--epochs", type=int, default=10)
    s.add_argument("--batch-size", type=int, default=64)
    s.add_argument("--lr", type=float, default=2e-3)
    s.add_argument("--mode", default=DEFAULT_CLI_MODE, choices=mode_names, help=modes_help)
    s.add_argument("--clipping", default="automatic", choices=["automatic", "abadi"])
    s.add_argument("--max-grad-norm", type=float, default=1.0)
    s.add_argument(
        "--accountant",
        default="rdp",
        choices=accountants,
        help="a registered accountant whose ε is an upper bound (dpzoo.register_accountant adds one)",
    )
    s.add_argument("--full-size", action="store_true", help="the entry's full size instead of its small configuration")
    s.add_argument("--set", action="append", metavar="KEY=VALUE", help="a model override (JSON value)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--device", default="cpu", help="sequence models: where to train (cpu, cuda, cuda:1, ...)")
    s.add_argument(
        "--non-private",
        action="store_true",
        help="sequence models: the same training without clipping or noise (a reference, no guarantee)",
    )
    s.add_argument("--out", help="directory for the trained model and metrics.json")
    s.set_defaults(fn=_cmd_train)
    s = sub.add_parser("audit", help="empirical privacy audit in one training run (Steinke et al. 2023)")
    s.add_argument("--epsilon", type=float, default=2.0, help="the claimed ε the engine is calibrated to")
    s.add_argument("--delta", type=float, default=1e-5)
    s.add_argument("--canaries", type=int, default=1000, help="m: each is in the training set with probability 1/2")
    s.add_argument("--epochs", type=int, default=10)
    g = s.add_mutually_exclusive_group()
    g.add_argument(
        "--broken",
        choices=["no-noise", "unclipped"],
        default=None,
        help="audit a deliberately broken mechanism instead (a positive control)",
    )
    g.add_argument(
        "--with-controls",
        action="store_true",
        help="audit dpzoo's engine and both positive controls (exit 3 if a control does not fire)",
    )
    s.add_argument("--batch-size", type=int, default=64)
    s.add_argument("--lr", type=float, default=2.0)
    s.add_argument("--max-grad-norm", type=float, default=1.0)
    s.add_argument("--confidence", type=float, default=0.95)
    s.add_argument(
        "--accountant",
        default="rdp",
        choices=accountants,
        help="a registered accountant whose ε is an upper bound (dpzoo.register_accountant adds one)",
    )
    s.add_argument(
        "--seed",
        type=int,
        default=0,
        help="fixes the canaries, their inclusion and the initialisation (the engine's noise stays secret)",
    )
    s.add_argument("--out", help="directory for audit.json (and score histograms with matplotlib)")
    s.set_defaults(fn=_cmd_audit)
    s = sub.add_parser("cards", help="write the markdown model cards")
    s.add_argument("--write", required=True, metavar="DIR")
    s.set_defaults(fn=_cmd_cards)
    return p


def main(argv: list[str] | None = None) -> int:
    import dpzoo

    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except dpzoo.DPZooError as e:
        print(f"dpzoo: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
