"""Installed without MLX's backend (Linux, no [cpu]/[cuda] extra): every command ends with
one line saying which extra to install."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# What `import mlx.core` raises on Linux when only `mlx` is installed (no mlx-cpu / mlx-cuda:
# the extension cannot find libmlx.so), simulated by an import hook loaded at start-up.
NO_BACKEND = '''
import sys

class NoBackend:
    def find_spec(self, name, path=None, target=None):
        if name == "mlx.core":
            raise ImportError("libmlx.so: cannot open shared object file: No such file or directory")
        return None

sys.meta_path.insert(0, NoBackend())
'''


@pytest.mark.parametrize("command", [
    ["-m", "mlx_mla.generate", "--prompt", "hi"],
    ["-m", "mlx_mla.compare"],
    ["-m", "convert", "--hf-path", "x", "--mlx-path", "y", "-q"],
    ["-c", "import mlx_mla"],
])
def test_every_command_names_the_extra(tmp_path, command):
    (tmp_path / "sitecustomize.py").write_text(NO_BACKEND)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    out = subprocess.run([sys.executable, *command], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=120)
    err = out.stderr.strip().splitlines()
    assert out.returncode == 1
    assert len(err) == 1 and "Traceback" not in out.stderr, out.stderr
    assert err[0].startswith("error: MLX's backend is not installed (libmlx.so")
    assert 'pip install "mlx-mla[cpu]"' in err[0] and '"mlx-mla[cuda]"' in err[0]


def test_advice_per_platform():
    from mlx_mla.backend import install_advice

    assert "mlx-mla[cpu]" in install_advice("linux")
    assert install_advice("darwin").startswith("reinstall MLX: pip install --force-reinstall mlx")
