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

# JAX's persistent compilation cache, one fresh directory per session (removed at its end), shared
# by this process and the CLI subprocesses the end-to-end tests start (they inherit the variables).
# Many tests compile the same tiny programs again (a new jitted closure per Learner, per engine, per
# CLI process); a cache hit is the executable XLA would have built, so no computed number changes.
# (Measured: test_smoke_each_correction's 5 runs took 199 s cold and 68 s warm; the whole suite ran
# in 60 min here beside other jobs, against 80 min in the last CI run without it.) TPU-topology
# compiles turn it off (``jax_rl.compile.topology.no_persistent_cache``). A JAX_COMPILATION_CACHE_DIR set by the
# caller is kept.
_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    _OWN_CACHE = tempfile.mkdtemp(prefix="jax_rl_test_xla_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import pytest  # noqa: E402


def pytest_sessionfinish(session, exitstatus):
    if _OWN_CACHE is not None:
        import shutil

        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """``full_depth`` tests (the TPU configs compiled at full depth, ~20 min on two cores) run only
    with JAX_RL_FULL_DEPTH=1 (``make test-full-depth``). ``slow`` tests (the long end-to-end runs) are
    deselected by ``make test`` (``-m "not slow"``) and run by ``make test-slow``: docs/testing.md."""
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
