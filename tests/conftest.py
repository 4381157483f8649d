"""Test setup: 8 fake CPU devices, set before jax is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """``full_depth`` tests (the TPU configs compiled at full depth, ~20 min on two cores) run only
    with JAX_RL_FULL_DEPTH=1 (``make test-full-depth``), so ``make test`` stays near 25 minutes."""
    if os.environ.get("JAX_RL_FULL_DEPTH") == "1":
        return
    skip = pytest.mark.skip(reason="full-depth TPU compile: run with JAX_RL_FULL_DEPTH=1 (make test-full-depth)")
    for item in items:
        if "full_depth" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def devices():
    d = jax.devices()
    assert len(d) == 8, f"expected 8 fake CPU devices, got {len(d)}"
    return d
