"""README.md's figures: the install, the main job (``benchmarks/main_job.py``), its command line, the
ResNet example and the test suite (``benchmarks/first_hour.py``)."""

from __future__ import annotations

from pathlib import Path

from doc_tables import figures
from doc_tables.prose import fixed, load

MAIN_JOB = "benchmarks/results/main_job/main_job.json"
FIRST_HOUR = "benchmarks/results/first_hour/{}.json"


@figures("install", files=[FIRST_HOUR.format("install")], command="benchmarks/first_hour.py install")
def install(root: Path) -> set[str]:
    data = load(root, FIRST_HOUR.format("install"))
    return fixed([data["seconds"] / 60], 1) | fixed([data["venv_gb"]], 1)


@figures("main-job", files=[MAIN_JOB], command="benchmarks/main_job.py")
def main_job(root: Path) -> set[str]:
    """Test accuracy in %: the mean and range over the DP runs, and the same recipe without DP."""
    data = load(root, MAIN_JOB)
    keys = ("mean_test_accuracy", "min_test_accuracy", "max_test_accuracy", "non_private_test_accuracy")
    return fixed([data[k] for k in keys], 1, scale=100)


@figures("main-job-cli", files=[FIRST_HOUR.format("cli")], command="benchmarks/first_hour.py cli")
def main_job_cli(root: Path) -> set[str]:
    """The command's wall time and its training time, in whole seconds."""
    data = load(root, FIRST_HOUR.format("cli"))
    return fixed([data["seconds"], data["last_epoch"]["seconds"]], 0)


@figures("resnet-example", files=[FIRST_HOUR.format("resnet")], command="benchmarks/first_hour.py resnet")
def resnet_example(root: Path) -> set[str]:
    """Test accuracy in % (mean and range over the runs) and the small configuration's size in thousands."""
    data = load(root, FIRST_HOUR.format("resnet"))
    keys = ("mean_test_accuracy", "min_test_accuracy", "max_test_accuracy")
    return fixed([data[k] for k in keys], 0, scale=100) | fixed([data["parameters"] / 1000], 0)


@figures("test-suite", files=[FIRST_HOUR.format("tests")], command="benchmarks/first_hour.py tests")
def test_suite(root: Path) -> set[str]:
    data = load(root, FIRST_HOUR.format("tests"))
    return fixed([data["seconds"] / 60], 0)
