"""tpu_scripts/: shellcheck clean, settings overridable, compile_check calls `jax-rl compile`."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "tpu_scripts").glob("*.sh"))


def test_scripts_exist_and_are_executable():
    names = {p.name for p in SCRIPTS}
    assert {"create.sh", "setup.sh", "launch.sh", "compile_check.sh", "common.sh"} <= names
    for p in SCRIPTS:
        if p.name != "common.sh":
            assert os.access(p, os.X_OK), p


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_shellcheck_clean():
    r = subprocess.run(["shellcheck", "-x", "-s", "bash", *map(str, SCRIPTS)], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_compile_check_runs_jax_rl_compile_for_the_topology_on_cpu(tmp_path):
    fake = tmp_path / "jax-rl"
    fake.write_text('#!/usr/bin/env bash\necho "JAX_PLATFORMS=$JAX_PLATFORMS" "$@"\n')
    fake.chmod(0o755)
    env = dict(os.environ, JAX_RL=str(fake), TOPOLOGY="v5e:2x2", CONFIG="configs/tiny_cpu.yaml",
               TRAIN_ARGS="model.scan_layers=true")
    r = subprocess.run(["bash", str(ROOT / "tpu_scripts" / "compile_check.sh")], cwd=ROOT,
                       env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["JAX_PLATFORMS=cpu", "compile", "configs/tiny_cpu.yaml",
                                "--topology", "v5e:2x2", "model.scan_layers=true"]
