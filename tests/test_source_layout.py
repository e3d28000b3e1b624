"""The package's shape, checked by parsing its sources: modules of one job and a bounded size,
no module reaching into another's private names, deliberate errors that are DPZooErrors, and
nothing of the development machine in the library (docs/DESIGN.md, "Package map")."""

from __future__ import annotations

import ast
import builtins
import collections
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIBRARY = sorted((ROOT / "dpzoo").rglob("*.py"))
EVERYTHING = LIBRARY + sorted(p for d in ("tests", "benchmarks", "examples") for p in (ROOT / d).rglob("*.py"))
MAX_LINES = 400

# Builtin exceptions raised inside a helper and caught by its caller, never reaching a user.
INTERNAL_RAISES = {
    ("dpzoo/seqrec/formats.py", "_split_fields"),  # a malformed line: the reader counts and reports it
    ("dpzoo/seqrec/formats.py", "_int"),
    ("dpzoo/seqrec/formats.py", "_parse_amazon"),
    ("dpzoo/__init__.py", "__getattr__"),  # PEP 562: a missing attribute must be an AttributeError
    ("dpzoo/integrations/opacus.py", "__getattr__"),
}
BUILTIN_EXCEPTIONS = {n for n in dir(builtins) if n.endswith(("Error", "Exception"))} - {"NotImplementedError"}


def _rel(path: pathlib.Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _self_store(node: ast.Attribute) -> bool:
    return isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")


def _owners(files) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Private names each file defines (functions, classes, module names, ``self._x``), and
    attributes a file sets on objects it does not own (markers such as ``model._dpzoo_engine``)."""
    owners: dict[str, set[str]] = collections.defaultdict(set)
    markers: dict[str, set[str]] = collections.defaultdict(set)
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                owners[node.name].add(_rel(path))
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                owners[node.id].add(_rel(path))
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                (owners if _self_store(node) else markers)[node.attr].add(_rel(path))
    return owners, markers


def _by_string(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call) or len(node.args) < 2:
        return False
    f = node.func
    name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
    arg = node.args[1]
    return (
        name in ("getattr", "setattr", "hasattr", "delattr")
        and isinstance(arg, ast.Constant)
        and isinstance(arg.value, str)
    )


def _cross_module_private_uses(files) -> list[str]:
    owners, markers = _owners(files)
    found = []
    for path in files:
        me = _rel(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                uses = [a.name for a in node.names]
            elif isinstance(node, ast.Attribute):
                uses = [node.attr]
            elif _by_string(node):  # getattr(x, "_name"), monkeypatch.setattr(module, "_name", ...)
                uses = [node.args[1].value]
            else:
                continue
            for name in filter(_private, uses):
                owned_by = owners.get(name) or markers.get(name) or {me}
                if me not in owned_by:
                    found.append(f"{me}:{node.lineno}: {name} (defined in {', '.join(sorted(owned_by))})")
    return found


def test_no_module_uses_another_modules_private_names():
    # torch's own private names (e.g. _BatchNorm) are not defined here and are not checked.
    assert _cross_module_private_uses(EVERYTHING) == []


def test_the_check_finds_private_uses(tmp_path):
    """The check above is not vacuous: an import of another module's private name, an attribute
    read and an access by name string are reported; a module's own ``self._x`` is not."""
    probe = ROOT / "tests" / "_layout_probe_tmp.py"  # inside the tree: names are relative to ROOT
    probe.write_text(
        "from dpzoo.registry import _REGISTRY\n"
        "import dpzoo.privacy.data as d\n"
        "d._batch_len\n"
        "class Own:\n"
        "    def __init__(self):\n"
        "        self._mine = 1\n"
        "Own()._mine\n"
        "getattr(d, '_batch_len')\n"
        "monkeypatch.setattr(d, '_batch_len', None)\n"
    )
    try:
        found = _cross_module_private_uses(LIBRARY + [probe])
    finally:
        probe.unlink()
    mine = [f.split(" (")[0] for f in found if f.startswith("tests/_layout_probe_tmp.py")]
    assert mine == [
        f"tests/_layout_probe_tmp.py:{i}: {n}"
        for i, n in ((1, "_REGISTRY"), (3, "_batch_len"), (8, "_batch_len"), (9, "_batch_len"))
    ]


@pytest.mark.parametrize("path", LIBRARY, ids=_rel)
def test_modules_are_small_and_say_their_job(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{_rel(path)} has {lines} lines (> {MAX_LINES}): split it by job"
    doc = ast.get_docstring(ast.parse(path.read_text()))
    assert doc and doc.strip(), f"{_rel(path)} has no module docstring saying its job"


def _raises(path: pathlib.Path) -> list[tuple[str, str, int]]:
    """(innermost enclosing function, exception name, line) of every ``raise Name(...)``."""
    found = []

    def visit(node: ast.AST, func: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            func = node.name
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name):
                found.append((func, exc.id, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, func)

    visit(ast.parse(path.read_text()), "<module>")
    return found


@pytest.mark.parametrize("path", LIBRARY, ids=_rel)
def test_deliberate_errors_are_dpzoo_errors(path):
    """A builtin exception raised on purpose would bypass the command line's handler and the
    ``except DPZooError`` of a user; only helpers whose caller catches it may raise one."""
    bad = sorted(
        {
            f"{_rel(path)}:{line} raises {exc} (in {func})"
            for func, exc, line in _raises(path)
            if exc in BUILTIN_EXCEPTIONS and (_rel(path), func) not in INTERNAL_RAISES
        }
    )
    assert bad == []


@pytest.mark.parametrize("path", LIBRARY, ids=_rel)
def test_nothing_of_the_development_machine_in_the_library(path):
    text = path.read_text()
    assert "shared/data" not in text, f"{_rel(path)}: pass data paths in ($DPZOO_DATA), never a machine's path"
    assert not re.search(r"\bissues? #?\d+\b", text, re.I), f"{_rel(path)}: issue numbers belong in commit messages"


def test_lazy_public_names_stay_functions_after_their_submodules_are_imported():
    """``dpzoo.summary`` and ``dpzoo.audit`` are functions although submodules share their names
    (importing a submodule makes Python set the package attribute to it)."""
    code = (
        "import dpzoo.summary, dpzoo.audit.run, dpzoo, types\n"
        "assert callable(dpzoo.summary) and callable(dpzoo.audit), (dpzoo.summary, dpzoo.audit)\n"
        "assert not isinstance(dpzoo.summary, types.ModuleType)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# the brute-force references of the DP step: they may use dpzoo's models and norm hooks for their own
# checks, but never the clipping, noise or accounting code they exist to check
REFERENCES = ("tests/dp_reference.py", "tests/grad_reference.py")
CHECKED_CODE = ("dpzoo.privacy",)
CHECKED_NAMES = {"clip_factors", "AUTOMATIC_GAMMA", "CLIPPING", "noised_all_reduce", "secret_generator", "Accountant"}


def _imports(path: pathlib.Path) -> list[tuple[str, str]]:
    """(module, name) of every import in a file; name "" for ``import module``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, "") for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out += [(node.module or "", a.name) for a in node.names]
    return out


@pytest.mark.parametrize("path", REFERENCES)
def test_brute_force_references_share_no_privacy_code_with_dpzoo(path):
    bad = [
        f"{m}.{n}" if n else m
        for m, n in _imports(ROOT / path)
        if m.startswith(CHECKED_CODE) or (m.startswith("dpzoo") and n in CHECKED_NAMES)
    ]
    assert bad == [], f"{path} imports dpzoo's own privacy code: {bad}"


def test_no_test_takes_its_expected_clip_factors_from_dpzoo():
    """Expected DP updates use tests/dp_reference.py's closed form (a test of dpzoo's clip_factors
    itself would compare it with that closed form, not use it)."""
    users = [_rel(p) for p in sorted((ROOT / "tests").glob("*.py")) if ("dpzoo.privacy", "clip_factors") in _imports(p)]
    users += [
        _rel(p)
        for p in sorted((ROOT / "tests").glob("*.py"))
        if ("dpzoo.privacy.clipping", "clip_factors") in _imports(p)
    ]
    assert users == []


# -- functions that fit on a screen or two, and imports without cycles (issue 31) ---------------

MAX_FUNCTION_LINES = 80  # from `def` to the end, the docstring not counted
ONE_PIECE = "must be one piece"  # a docstring that says why a longer function cannot be split
# Functions still over the limit (twelve when the rule was introduced), with their length: each may
# only shrink (split it and delete its line); none may be added. docs/DESIGN.md "Package map".
LONG_FUNCTIONS = {}


def _long_functions(files) -> dict[tuple[str, str], int]:
    """(file, function) -> body lines, for every function over the limit whose docstring does not
    say why it must be one piece."""
    found = {}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            lines = node.end_lineno - node.lineno + 1
            doc = ast.get_docstring(node)
            if doc is not None:
                first = node.body[0]
                lines -= first.end_lineno - first.lineno + 1
            if lines > MAX_FUNCTION_LINES and ONE_PIECE not in (doc or ""):
                found[(_rel(path), node.name)] = lines
    return found


def test_functions_fit_on_a_screen_or_two():
    found = _long_functions(LIBRARY)
    new = {k: v for k, v in found.items() if k not in LONG_FUNCTIONS}
    grown = {k: (LONG_FUNCTIONS[k], v) for k, v in found.items() if k in LONG_FUNCTIONS and v > LONG_FUNCTIONS[k]}
    assert new == {}, f"functions over {MAX_FUNCTION_LINES} lines: {new}; split them (or say why not: {ONE_PIECE!r})"
    assert grown == {}, f"listed long functions grew (listed, now): {grown}"
    gone = sorted(set(LONG_FUNCTIONS) - set(found))
    assert gone == [], f"{gone} are short now (or gone): delete them from LONG_FUNCTIONS"


def test_the_length_check_finds_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    short = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES - 1))  # with its def line: the limit
    probe = ROOT / "tests" / "_layout_probe_long_tmp.py"
    probe.write_text(f'def long():\n    """A docstring."""\n{body}\n    return x0\n\n\ndef fits():\n{short}\n')
    try:
        found = _long_functions([probe])
        probe.write_text(f'def long():\n    """It {ONE_PIECE}: a reason."""\n{body}\n    return x0\n')
        excused = _long_functions([probe])
    finally:
        probe.unlink()
    assert found == {("tests/_layout_probe_long_tmp.py", "long"): MAX_FUNCTION_LINES + 2} and excused == {}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph(files, top_level_only: bool) -> dict[str, set[str]]:
    """Module -> the library modules it imports (``from P import name`` counts as P.name when that
    is a module); imports under ``if TYPE_CHECKING:`` are not imports."""
    modules = {_module_name(p): p for p in files}

    def resolve(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        typing_only = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for stmt in node.body
            for n in ast.walk(stmt)
        }
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in tree.body if top_level_only else ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                targets |= {resolve(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets |= {resolve(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base) for a in node.names}
        graph[name] = {t for t in targets if t and t != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_when_modules_load():
    """Module-level imports (what runs on ``import``) form no cycle."""
    assert _cycles(_import_graph(LIBRARY, top_level_only=True)) == []


def test_no_import_cycle_even_through_imports_inside_functions():
    """No module reaches back to itself through any import, lazy ones (inside functions) included:
    a lower layer never calls up (docs/DESIGN.md "Package map")."""
    assert _cycles(_import_graph(LIBRARY, top_level_only=False)) == []


def test_the_cycle_checks_find_a_cycle():
    probe = ROOT / "tests" / "_layout_probe_cycle_tmp"
    probe.mkdir()
    try:
        (probe / "a.py").write_text("from . import b\n")
        (probe / "b.py").write_text("def f():\n    from . import a\n")
        (probe / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n")
        files = sorted(probe.glob("*.py"))
        lazy = _cycles(_import_graph(files, top_level_only=False))
        loading = _cycles(_import_graph(files, top_level_only=True))
    finally:
        for p in probe.glob("*.py"):
            p.unlink()
        probe.rmdir()
    names = ["tests._layout_probe_cycle_tmp.a", "tests._layout_probe_cycle_tmp.b"]
    assert lazy == [names] and loading == []
