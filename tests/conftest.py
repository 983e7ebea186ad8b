"""Session fixtures: the Hub-layout fixture checkpoint and the held-out text excerpt,
rebuilt from what the repository holds (``testdata``)."""

from pathlib import Path

import pytest

from testdata import CORPUS, make_hub_fixture


@pytest.fixture(scope="session")
def fixture_dir(tmp_path_factory) -> Path:
    """tiny-dsv2-lite-shakespeare in Hub layout, read-only (see ``testdata``)."""
    return make_hub_fixture(tmp_path_factory.mktemp("fixture") / "tiny-dsv2-lite-shakespeare")


@pytest.fixture(scope="session")
def corpus_text() -> str:
    """16 KB of held-out Shakespeare (never trained on)."""
    return CORPUS.read_text()
