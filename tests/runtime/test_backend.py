"""The backend JAX runs on: ``jax-rl --version`` names it with its devices, a ``JAX_PLATFORMS`` naming a
platform this host lacks ends a ``train --dry-run`` with one line naming it (exit 2), never the CPU in
its place; the one chip table (:data:`jax_rl.compile.chips.CHIPS`) maps JAX device kinds to vendor figures."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jax_rl.compile import chips
from jax_rl.compile import topology as tpu
from jax_rl.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_version_prints_versions_backend_and_devices(capsys):
    import jax

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    out = capsys.readouterr().out.splitlines()
    assert e.value.code == 0
    assert out[0].startswith("jax-rl ") and out[1] == f"jax {jax.__version__}" and out[2].startswith("jaxlib ")
    assert out[3] == f"backend: {jax.default_backend()}"
    assert out[4] == f"devices: {jax.device_count()} x {jax.devices()[0].device_kind}"


def _absent_platform_env():
    # cuda: no NVIDIA GPU and no CUDA plugin here (libtpu IS installed, so 'tpu' would be tried for real)
    if os.path.exists("/dev/nvidia0"):
        pytest.skip("this host has an NVIDIA GPU: cuda is not an absent platform here")
    return dict(os.environ, JAX_PLATFORMS="cuda", PYTHONPATH=str(ROOT))


def test_version_with_an_absent_backend_prints_the_error_in_one_line():
    r = subprocess.run([sys.executable, "-m", "jax_rl.cli", "--version"], env=_absent_platform_env(),
                       capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    err = [ln for ln in r.stdout.splitlines() if ln.startswith("backend:")]
    assert len(err) == 1 and "error" in err[0] and "JAX_PLATFORMS=cuda" in err[0], r.stdout
    assert "Traceback" not in r.stderr


def test_train_dry_run_on_an_absent_platform_is_one_line_naming_it():
    r = subprocess.run([sys.executable, "-m", "jax_rl.cli", "train", "configs/tiny_cpu.yaml", "--dry-run"],
                       env=_absent_platform_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
    assert lines[0].startswith("jax-rl: error: JAX_PLATFORMS=cuda") and "not available" in lines[0], lines
    assert "parameters" not in r.stdout  # it stopped; it did not fall back to the CPU and run


@pytest.mark.parametrize("kind,name", [("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H200", "h200"),
                                       ("NVIDIA A100-SXM4-80GB", "a100-80gb"), ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
                                       ("NVIDIA H100 PCIe", "h100-pcie"), ("TPU v5 lite", "v5e"), ("TPU v5", "v5p"),
                                       ("TPU v5p", "v5p"), ("TPU v6 lite", "v6e"), ("TPU v4", "v4"), ("cpu", None)])
def test_chip_for_device_kinds(kind, name):
    spec = chips.chip_for(kind)
    assert (spec.name if spec else None) == name


def test_one_chip_table():
    assert tpu.CHIPS is chips.TPU_CHIPS and all(chips.CHIPS[k] is v for k, v in tpu.CHIPS.items())
    for c in chips.GPU_CHIPS.values():  # vendor units: bytes, FLOP/s, bytes/s
        assert 30e9 < c.hbm_bytes < 200e9 and 2e14 < c.peak_bf16_flops < 2e15 and 1e12 < c.hbm_bandwidth < 6e12
        assert c.source.startswith("https://www.nvidia.com/")
