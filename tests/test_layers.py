"""The layer rules (pyproject.toml's import-linter contracts) hold, and they would catch a model
file that imported a device wing: `lint-imports` fails on a copy of the package that does."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
LINT_IMPORTS = pathlib.Path(sys.executable).with_name("lint-imports")


def _lint_imports(root: pathlib.Path) -> subprocess.CompletedProcess:
    # the copy's package first on the path: grimp builds the graph of what it imports
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_tree_keeps_every_layer_contract():
    done = _lint_imports(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def test_a_model_file_that_imports_a_device_wing_breaks_the_contract(tmp_path):
    shutil.copytree(ROOT / "actorlm", tmp_path / "actorlm",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    model_file = tmp_path / "actorlm" / "models" / "decoder.py"
    model_file.write_text(model_file.read_text().replace(
        "from actorlm.kernels import", "from actorlm.kernels.cpu import fused  # noqa: F401\n"
        "from actorlm.kernels import", 1))
    done = _lint_imports(tmp_path)
    assert done.returncode != 0
    assert "models reach the kernels through the door only: no device wing BROKEN" in done.stdout
    assert "actorlm.models.decoder -> actorlm.kernels.cpu.fused" in done.stdout
