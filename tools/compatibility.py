"""Run dpzoo's core exactness suites at each end of the supported torch / transformers range.

For each version set it builds a fresh venv (``--root``, kept between runs so a re-run reuses the
download), installs ``dpzoo[test]`` with that set's pins, and runs the suites below with pytest;
then writes ``benchmarks/results/compatibility.json`` and the table in ``docs/COMPATIBILITY.md``
(versions × suites, passed / failed, date). Not part of ``.ci/run``: each venv is a ~6 GB install.

    python tools/compatibility.py                    # both ends (about 10 min per set on 2 cores)
    python tools/compatibility.py --sets torch-2.6   # one set; the others keep their last results

The ``newest`` set is the lock (``constraints.txt``), i.e. what CI and the README's install get;
``lowest`` pins the oldest torch, torchvision and transformers dpzoo supports and lets pip resolve
the rest. ``dpzoo.versions.TESTED`` must name the ends that passed here.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "compatibility.json"
DOC = ROOT / "docs" / "COMPATIBILITY.md"

# the core exactness suites: per-sample norms vs brute force, the DP step vs the DP-SGD formula,
# the adversarial corpus, the privacy edges, and the audit with its own cases
SUITES = {
    "per-sample norms": ["tests/test_grad_norms_rules.py", "tests/test_grad_norms_adversarial.py"],
    "zoo norms": ["tests/test_grad_norms_zoo.py", "tests/test_layer_coverage.py"],
    "engine step": ["tests/test_engine.py"],
    "adversarial corpus": ["tests/test_adversarial_corpus.py"],
    "privacy edges": ["tests/test_privacy_edges.py", "tests/test_independent_audit.py"],
}

SETS = {
    "lowest": {"pins": ["torch===2.11.0", "torchvision==0.26.0", "transformers==5.4.0"], "constraints": False},
    "newest": {"pins": [], "constraints": True},
    # below the range, kept to show why: torch 2.6 fails the guard tests (see docs/COMPATIBILITY.md);
    # transformers before 5.4 returns a tuple from OPTDecoderLayer (the OPT swap is refused)
    "torch-2.6": {
        "pins": ["torch==2.6.0", "torchvision==0.21.0", "transformers==5.0.0"],
        "constraints": False,
        "below_range": True,
    },
}
REPORTED = ("torch", "transformers", "timm", "opacus", "peft", "accelerate", "numpy")


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("$", " ".join(cmd), flush=True)
    return subprocess.run(cmd, text=True, **kw)


def build(name: str, spec: dict, root: Path) -> Path:
    env = root / name
    python = env / "bin" / "python"
    if not python.exists():
        venv.create(env, with_pip=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    if spec.get("below_range"):  # pyproject's bounds exclude these pins: its dependencies unbounded, then dpzoo
        cmds = [pip + [*spec["pins"], *_unbounded_dependencies()], pip + ["--no-deps", "-e", str(ROOT)]]
    else:
        cmds = [pip + ["-e", f"{ROOT}[test]", *spec["pins"]]]
        if spec["constraints"]:
            cmds[0] += ["-c", str(ROOT / "constraints.txt")]
    for cmd in cmds:
        if run(cmd).returncode:
            raise SystemExit(f"installing the {name} set failed: see pip's output above")
    return python


def _unbounded_dependencies() -> list[str]:
    """pyproject's dependencies and test extra, names only (a set below the declared range)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = project["dependencies"] + project["optional-dependencies"]["test"]
    return [re.split(r"[<>=!~; \[]", s, maxsplit=1)[0] for s in specs]


def versions_of(python: Path) -> dict[str, str]:
    code = f"import json, importlib.metadata as m\nprint(json.dumps({{p: m.version(p) for p in {list(REPORTED)!r}}}))"
    out = run([str(python), "-c", code], capture_output=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def summary_counts(text: str) -> dict[str, int]:
    """pytest's last line ("3 failed, 120 passed, 2 skipped in 40s") as counts."""
    last = [line for line in text.splitlines() if re.search(r"\d+ (passed|failed|error)", line)]
    return {
        k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed)", last[-1] if last else "")
    }


def run_suites(python: Path) -> dict[str, dict]:
    out = {}
    for suite, files in SUITES.items():
        proc = run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *files], cwd=ROOT, capture_output=True)
        counts = summary_counts(proc.stdout)
        failed = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
        out[suite] = {"returncode": proc.returncode, "counts": counts, "failed": failed[:20]}
        print(f"  {suite}: {counts} (rc {proc.returncode})", flush=True)
    return out


def table(results: dict) -> str:
    names = [n for n in SETS if n in results]
    head = "| suite | " + " | ".join(
        f"{n}: torch {results[n]['versions']['torch']}, transformers {results[n]['versions']['transformers']}"
        for n in names
    )
    lines = [head + " |", "| --- |" + " --- |" * len(names)]
    for suite in SUITES:
        cells = []
        for n in names:
            r = results[n]["suites"].get(suite)
            if r is None:
                cells.append("not run")
                continue
            c = r["counts"]
            bad = c.get("failed", 0) + c.get("error", 0) + c.get("errors", 0)
            verdict = "pass" if r["returncode"] == 0 else f"**FAIL** ({bad} failed)"
            cells.append(
                f"{verdict}: {c.get('passed', 0)} passed" + (f", {c['skipped']} skipped" if c.get("skipped") else "")
            )
        lines.append(f"| {suite} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_doc(results: dict) -> None:
    text = DOC.read_text() if DOC.exists() else ""
    start, end = "<!-- compatibility table: tools/compatibility.py -->", "<!-- end of table -->"
    body = f"{start}\n{table(results)}\n\n" + "\n".join(
        f"- **{n}** ({results[n]['date']}, {results[n].get('commit', 'commit not recorded')}, Python {results[n]['python']}): "
        + ", ".join(f"{p} {v}" for p, v in results[n]["versions"].items())
        for n in SETS
        if n in results
    )
    body += f"\n{end}"
    if start in text:
        text = text[: text.index(start)] + body + text[text.index(end) + len(end) :]
    else:
        text += "\n" + body + "\n"
    DOC.write_text(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", nargs="+", default=["lowest", "newest"], choices=list(SETS))
    ap.add_argument("--root", type=Path, default=Path("/tmp/dpzoo-compat"), help="where the venvs are built")
    args = ap.parse_args(argv)
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    for name in args.sets:
        python = build(name, SETS[name], args.root)
        py = run([str(python), "-c", "import platform; print(platform.python_version())"], capture_output=True)
        commit = run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True).stdout.strip()
        results[name] = {
            "date": datetime.date.today().isoformat(),
            "commit": commit,
            "python": py.stdout.strip(),
            "pins": SETS[name]["pins"] or ["constraints.txt"],
            "versions": versions_of(python),
            "suites": run_suites(python),
        }
        RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    write_doc(results)
    print(table(results))
    return 0 if all(r["returncode"] == 0 for n in args.sets for r in results[n]["suites"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
