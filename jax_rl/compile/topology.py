"""Cloud TPU topologies for compiling from a CPU host: a Cloud TPU type (``v5e-8``, ``v5litepod-8``, ``v5p-8``,
``v5p-64``, ``v6e-8``, ``v4-16``) or a raw topology name (``v5p:4x4x4``) -> the arguments of
``jax.experimental.topologies.get_topology_desc`` (:func:`resolve_topology`) and the TopologyDescription
itself (:func:`get_topology`). Cloud names count TensorCores for v4 and v5p (2 per chip: ``v5p-8`` is 4
chips) and chips for v5e and v6e (``v5e-8`` is 8 chips).

``cpu_unless_tpu_present`` keeps a CPU host with libtpu installed from probing for a TPU
(JAX would print libtpu initialisation errors, then fall back to the CPU).
``no_persistent_cache`` turns JAX's persistent compilation cache off around a TPU compile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import importlib.util
import math
import os
import re

from jax_rl.compile.chips import TPU_CHIPS, ChipSpec

CHIPS: dict[str, ChipSpec] = TPU_CHIPS
"""The TPU generations of :data:`jax_rl.compile.chips.CHIPS` (the one chip table; the figures and their sources are there)."""

_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v6": "v6e", "v5": "v5p"}
_3D = ("v4", "v5p")  # 3-D torus generations (topology AxBxC)

__all__ = ["CHIPS", "TopologySpec", "resolve_topology", "get_topology", "cpu_unless_tpu_present", "libtpu_available", "quiet_libtpu_env",
           "no_persistent_cache"]


@dataclasses.dataclass(frozen=True)
class TopologySpec:
    """``get_topology_desc(platform="tpu", topology_name=topology_name)`` arguments plus the
    chip and chip count. ``topology_name`` is ``<gen>:<AxB[xC]>`` (chips per dimension)."""

    chip: ChipSpec
    topology_name: str
    num_chips: int


def _grid_2d(chips: int) -> str:
    a = 1 << (int(math.log2(chips)) // 2)
    return f"{a}x{chips // a}"


def _grid_3d(chips: int) -> str:
    """3-D torus shape of a v4/v5p slice: 2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4, 4x4x8, ..."""
    dims = [2, 2, 1] if chips >= 4 else [1, 1, 1]
    while math.prod(dims) < chips:
        i = max(j for j in range(3) if dims[j] == min(dims))
        dims[i] *= 2
    return "x".join(map(str, dims))


def resolve_topology(name: str) -> TopologySpec:
    """``v5e-8`` / ``v5litepod-8`` / ``v5p-64`` / ``v6e-8`` / ``v4-16`` / ``v5p:4x4x4`` ->
    ``TopologySpec``. Raises ValueError for an unknown generation or a count that is not a
    power of two."""
    name = name.strip().lower()
    m = re.fullmatch(r"(v\d+[a-z]*):(\d+(?:x\d+){1,2})", name)
    if m:
        gen = _ALIASES.get(m.group(1), m.group(1))
        if gen not in CHIPS:
            raise ValueError(f"unknown TPU generation {m.group(1)!r} in {name!r}; one of {sorted(CHIPS)}")
        dims = [int(d) for d in m.group(2).split("x")]
        return TopologySpec(CHIPS[gen], f"{gen}:{m.group(2)}", math.prod(dims))
    m = re.fullmatch(r"(v\d+[a-z]*)-(\d+)", name)
    if not m:
        raise ValueError(f"TPU topology {name!r}: expected a Cloud TPU type like v5p-64 or a "
                         "topology like v5p:4x4x4")
    gen = _ALIASES.get(m.group(1), m.group(1))
    if gen not in CHIPS:
        raise ValueError(f"unknown TPU generation {m.group(1)!r}; one of {sorted(CHIPS)}")
    n = int(m.group(2))
    chips = n // 2 if gen in _3D else n
    if chips < 1 or chips & (chips - 1):
        raise ValueError(f"{name!r}: {chips} chips is not a power of two")
    grid = _grid_3d(chips) if gen in _3D else _grid_2d(chips)
    return TopologySpec(CHIPS[gen], f"{gen}:{grid}", chips)


@contextlib.contextmanager
def no_persistent_cache():
    """JAX's persistent compilation cache (``JAX_COMPILATION_CACHE_DIR``) off inside the block,
    as it was after.

    For compiles that target a TPU topology from a host without a TPU: libtpu writes their
    executables to the cache but cannot read them back (``PjRtCompiler must be constructed with a
    Client to call DeserializeLoadedExecutable``, a warning and a recompile each time), and a
    cache hit would make a reported ``compile_s`` meaningless. JAX decides once per process
    whether the cache is used, so the decision is reset on entry and on exit
    (``jax.experimental.compilation_cache.compilation_cache.reset_cache``)."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc

    prev = bool(jax.config.jax_enable_compilation_cache)
    jax.config.update("jax_enable_compilation_cache", False)
    cc.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", prev)
        cc.reset_cache()


def libtpu_available() -> bool:
    """True when the libtpu wheel (the ``tpu`` extra) is importable."""
    return importlib.util.find_spec("libtpu") is not None


def get_topology(name: str):
    """The ``jax.experimental.topologies`` TopologyDescription (``.devices`` are TPU devices
    that ``jit(...).lower(...).compile()`` targets from any host). Raises RuntimeError when
    libtpu is not installed, ValueError (one line) for a topology libtpu rejects (e.g.
    ``v5e:1x1``: smaller than one host's 2x2 chips)."""
    if not libtpu_available():
        raise RuntimeError("compiling for a TPU needs libtpu: pip install -e '.[tpu]'")
    from jax.experimental import topologies

    spec = resolve_topology(name)
    quiet_libtpu_env(spec)
    try:
        return topologies.get_topology_desc(platform="tpu", topology_name=spec.topology_name)
    except Exception as e:  # jax.errors.JaxRuntimeError: INVALID_ARGUMENT from libtpu
        msg = " ".join(str(e).split())
        raise ValueError(f"libtpu cannot build topology {spec.topology_name}: {msg[:300]}") from None


def _cloud_type(spec: TopologySpec) -> str:
    """The Cloud TPU accelerator type of a topology (``v5litepod-4``, ``v5p-8``, ``v6e-8``)."""
    gen = spec.chip.name
    if gen == "v5e":
        return f"v5litepod-{spec.num_chips}"
    return f"{gen}-{spec.num_chips * (2 if gen in _3D else 1)}"


def quiet_libtpu_env(spec: TopologySpec, environ=os.environ) -> None:
    """On a host without TPU devices, libtpu's first initialisation probes the GCE metadata
    server and prints warnings and an INVALID_ARGUMENT error for the accelerator type and
    worker hostnames it cannot find. Name them (a single local worker of the compiled
    topology's type) unless the environment already does, and allow several processes to load
    libtpu at once (``ALLOW_MULTIPLE_LIBTPU_LOAD``; its lockfile guards a TPU this host does not
    have). A TPU VM is left alone."""
    if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
        return
    environ.setdefault("TPU_ACCELERATOR_TYPE", _cloud_type(spec))
    environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    # no TPU to share here: two compiling processes would otherwise fail on libtpu's lockfile
    environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def cpu_unless_tpu_present(environ=os.environ) -> bool:
    """Set ``JAX_PLATFORMS=cpu`` when it is unset, libtpu is installed and this host has no
    TPU device files (``/dev/accel*``, ``/dev/vfio/<n>``). Returns True if it set it. Call
    before jax initialises its backends."""
    if environ.get("JAX_PLATFORMS") or not libtpu_available():
        return False
    if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
        return False
    environ["JAX_PLATFORMS"] = "cpu"
    return True
