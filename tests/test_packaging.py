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
