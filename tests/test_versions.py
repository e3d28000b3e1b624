"""The tested-version guard: a torch or transformers outside dpzoo.versions.TESTED warns once."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

from dpzoo import versions
from dpzoo.errors import UntestedVersionWarning


def test_release_numbers_drop_local_and_pre_release_tags():
    assert versions.release("2.11.0+cu130") == (2, 11, 0)
    assert versions.release("5.24.0.dev0") == (5, 24, 0)
    assert versions.release("2.6") == (2, 6)


@pytest.mark.parametrize(
    "torch_version, transformers_version, outside",
    [
        ("2.14.1+cu130", "5.24.0", []),
        ("2.11.0", "5.4.0", []),
        ("2.10.0", "5.24.0", ["torch"]),
        ("2.15.0", "5.24.0", ["torch"]),
        ("2.14.1", "5.2.0", ["transformers"]),
        ("2.14.1", "5.25.0", ["transformers"]),
        ("2.14.1", None, []),  # not installed: nothing to check
    ],
)
def test_untested_names_each_package_outside_the_range(torch_version, transformers_version, outside):
    lines = versions.untested({"torch": torch_version, "transformers": transformers_version})
    assert [line.split()[0] for line in lines] == outside
    for line in lines:
        low, high = versions.TESTED[line.split()[0]]
        assert f"tested: {low} to {high}" in line


def test_the_installed_set_is_inside_the_tested_range():
    """The lock (constraints.txt) and TESTED must agree: CI installs the lock."""
    assert versions.untested() == []


def test_warns_once_naming_the_range(monkeypatch):
    versions.warn_if_untested.cache_clear()
    monkeypatch.setattr(versions, "installed", lambda p: {"torch": "2.99.0", "transformers": "5.4.0"}[p])
    with pytest.warns(UntestedVersionWarning, match=r"torch 2\.99\.0 \(tested: 2\.11\.0 to"):
        versions.warn_if_untested()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        versions.warn_if_untested()  # a second call is silent


def test_import_does_not_warn_on_the_tested_set():
    out = subprocess.run(
        [sys.executable, "-W", "error::UserWarning", "-c", "import dpzoo"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr


def _root():
    from pathlib import Path

    return Path(__file__).resolve().parent.parent


def test_readme_and_ci_install_the_lock():
    """A fresh machine gets the tested set: both install commands name constraints.txt."""
    root = _root()
    install = [line for line in (root / "README.md").read_text().splitlines() if "pip install -e" in line][0]
    assert "-c constraints.txt" in install
    assert '-e ".[test]" -c constraints.txt' in (root / ".ci" / "run").read_text()


def test_the_lock_pins_the_newest_tested_versions_and_pyproject_admits_the_range():
    import re

    root = _root()
    lines = (root / "constraints.txt").read_text().splitlines()
    pins = {k.lower(): v.lstrip("=") for k, v in (line.split("==", 1) for line in lines if "==" in line)}
    deps = re.findall(r'^\s*"([a-z]+[^"]*)",', (root / "pyproject.toml").read_text(), re.M)
    for package, (low, high) in versions.TESTED.items():
        assert versions.release(pins[package]) == versions.release(high), f"the lock's {package} is not TESTED's newest"
        spec = next(d for d in deps if re.match(rf"{package}\b", d))
        assert f">={low.rsplit('.', 1)[0]}" in spec and "<" in spec, f"pyproject's {spec!r} does not state the range"


def test_the_package_states_pyprojects_version():
    import re

    stated = re.search(r'^version = "([^"]+)"', (_root() / "pyproject.toml").read_text(), re.M)
    assert stated and versions.__version__ == stated.group(1)
    import dpzoo

    assert dpzoo.__version__ == versions.__version__
