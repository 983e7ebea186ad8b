"""What the wheel installs: every package of the tree, and no generic top-level `convert`."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_is_listed_and_convert_installs_under_a_project_name():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts)
               for p in (ROOT / "mlx_mla").rglob("__init__.py")}
    assert on_disk <= listed, f"packages missing from pyproject.toml: {sorted(on_disk - listed)}"
    assert tool["package-dir"] == {"mlx_mla_convert": "convert"}
    assert "convert" not in listed
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["mlx-mla-convert"] == "mlx_mla_convert.__main__:main"


def test_converter_data_files_are_installed():
    """convert/'s data (the mla recipe's prior) is listed as package data."""
    from fnmatch import fnmatch

    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    data = [p.name for p in (ROOT / "convert").iterdir() if p.is_file() and p.suffix != ".py"]
    assert "mla_prior.json" in data
    assert all(any(fnmatch(name, pat) for pat in patterns["mlx_mla_convert"]) for name in data), data
