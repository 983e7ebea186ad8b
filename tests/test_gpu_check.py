"""benchmarks/gpu_check.sh cannot run here (no GPU): check that it parses and that every
flag it passes to a benchmark is one that benchmark accepts."""

from __future__ import annotations

import importlib
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def test_script_parses_and_its_flags_exist(capsys):
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    text = SCRIPT.read_text().replace("\\\n", " ")
    calls = re.findall(r"python -m (benchmarks\.\w+)([^\n|]*)", text)
    assert {m for m, _ in calls} == {"benchmarks.mla_strategies", "benchmarks.e2e_decode"}
    for module, args in calls:
        with pytest.raises(SystemExit):
            importlib.import_module(module).main(["--help"])
        help_text = capsys.readouterr().out
        for flag in re.findall(r"(--[a-z][a-z0-9-]*)", args):
            assert flag in help_text, (module, flag)
