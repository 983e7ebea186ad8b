"""Shared fixtures: paths to the shared checkpoint and corpus."""

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
FIXTURE = SHARED / "fixtures" / "tiny-dsv2-lite-shakespeare"
CORPUS = SHARED / "corpus" / "shakespeare-heldout.txt"


@pytest.fixture(scope="session")
def fixture_dir() -> Path:
    assert FIXTURE.is_dir(), f"shared fixture missing at {FIXTURE}"
    return FIXTURE


@pytest.fixture(scope="session")
def corpus_path() -> Path:
    return CORPUS


def load_benchmark(name: str):
    """Import ``benchmarks/<name>.py`` as a module (benchmarks/ is scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
