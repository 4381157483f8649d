"""TPU facts and ahead-of-time compilation for a TPU topology from a CPU host.

Three parts:

* ``CHIPS``: the TPU part of :data:`jax_rl.chips.CHIPS` (per-chip HBM bytes, peak bf16 FLOP/s, HBM
  bandwidth, bidirectional ICI bandwidth, as published on Google Cloud's TPU pages; sources in
  ``ChipSpec.source``). Vendor peak figures, for roofline estimates, not measurements.
* ``resolve_topology``: a Cloud TPU type (``v5e-8``, ``v5litepod-8``, ``v5p-8``, ``v5p-64``,
  ``v6e-8``, ``v4-16``) or a raw topology name (``v5p:4x4x4``) -> the arguments of
  ``jax.experimental.topologies.get_topology_desc``. Cloud names count TensorCores for v4 and
  v5p (2 per chip: ``v5p-8`` is 4 chips) and chips for v5e and v6e (``v5e-8`` is 8 chips).
* ``compile_rollout``: AOT-compiles the rollout engine's prefill and decode steps
  (``rollout.engine.Qwen3Engine``) for a topology with ``jax.jit(...).lower(ShapeDtypeStruct
  ...).compile()`` through libtpu's compiler (the ``tpu`` extra) and returns
  ``memory_analysis()`` (bytes per chip) and ``cost_analysis()`` figures. These are
  compile-time estimates: nothing runs on a TPU, and ``cost_analysis`` counts a loop (e.g. a
  scanned layer stack) body once.

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
from typing import Any, Optional

from jax_rl.chips import TPU_CHIPS, ChipSpec

__all__ = ["ChipSpec", "CHIPS", "TopologySpec", "resolve_topology", "get_topology",
           "compile_rollout", "cpu_unless_tpu_present", "libtpu_available", "no_persistent_cache"]

GiB = 1 << 30
GB = 10 ** 9


CHIPS: dict[str, ChipSpec] = TPU_CHIPS
"""The TPU generations of :data:`jax_rl.chips.CHIPS` (the one chip table; the figures and their sources are there)."""

_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v6": "v6e", "v5": "v5p"}
_3D = ("v4", "v5p")  # 3-D torus generations (topology AxBxC)


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
    _quiet_libtpu_env(spec)
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


def _quiet_libtpu_env(spec: TopologySpec, environ=os.environ) -> None:
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


def _analysis(compiled) -> dict[str, Any]:
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list):  # older jax: one dict per computation
        cost = cost[0] if cost else {}
    out = {k: int(getattr(mem, k)) for k in (
        "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
        "temp_size_in_bytes", "generated_code_size_in_bytes") if hasattr(mem, k)}
    out["peak_bytes_per_chip"] = (out.get("argument_size_in_bytes", 0) + out.get(
        "output_size_in_bytes", 0) - out.get("alias_size_in_bytes", 0) + out.get("temp_size_in_bytes", 0))
    out["flops"] = float(cost.get("flops", 0.0))
    out["bytes_accessed"] = float(cost.get("bytes accessed", 0.0))
    return out


HBM_SIDE_OPTIONS = {"xla_msa_enable": False}
"""libtpu compile options for the *HBM-side count* of a program's bytes: memory-space assignment
(MSA) off, so no buffer is staged in VMEM. MSA runs after fusion, so the program has the same
fusions. ``cost_analysis`` counts every access in every memory space. With MSA on (the program
that runs), a weight prefetched into VMEM is counted three times: the HBM read, the VMEM write
and the VMEM read. With MSA off every access is an HBM access. Measured on libtpu 0.0.42 for a
one-layer Qwen3-4B decode step (64 slots x 4,096, v5e-4): 3,209 MiB counted by default, 2,536 MiB
with MSA off, for 1,958 MiB of params + cache (``bench/decode_compile.py``)."""


def compile_rollout(model_config, topology: str, *, slots: int = 16, max_cache_len: int = 2048,
                    prefill_len: int = 1024, dtype: str = "bfloat16",
                    model_kwargs: Optional[dict] = None,
                    only: tuple[str, ...] = ("prefill", "decode"),
                    compiler_options: Optional[dict] = None, mesh: Any = None) -> dict[str, dict[str, Any]]:
    """AOT-compile ``Qwen3Engine``'s prefill (batch 1, ``prefill_len`` tokens), decode step
    (``slots`` slots, ``max_cache_len`` cache) and, in ``only``, its append-prefill
    (``"append_prefill"``: ``slots`` rows of ``prefill_len`` new tokens onto kept K/V, an agent
    turn's program) for ``topology`` (see ``resolve_topology``), params and state replicated on every
    chip as the engine places them. ``only``: the steps to compile (each result has ``compile_s``,
    seconds).

    ``model_kwargs`` go to ``Qwen3ForCausalLM`` (default ``scan_layers=True``,
    ``attention="splash"``). Returns ``{"prefill": {...}, "decode": {...}, "topology": {...}}``;
    each step's dict has ``memory_analysis`` fields (bytes per chip), ``peak_bytes_per_chip``
    (arguments + outputs - aliases + temporaries), ``flops`` and ``bytes_accessed``
    (``cost_analysis``; a scanned loop body is counted once) and ``hbm_fraction``
    (peak / the chip's HBM). The decode dict also has ``params_per_chip`` and
    ``kv_cache_per_chip`` (bytes, from the argument shapes) and ``bytes_accessed_ratio`` =
    bytes accessed / (params + KV cache per chip) (1.0 = each read once; with
    ``scan_layers`` the loop body is counted once, so compare unrolled layouts). The decode
    step is compiled without an ambient mesh, as the engine runs it (its state donated);
    prefill under ``jax.set_mesh`` (splash). ``compiler_options`` go to ``Lowered.compile``
    (e.g. :data:`HBM_SIDE_OPTIONS`). Compile-time estimates, not TPU measurements.

    ``mesh``: an engine mesh ``('data', 'fsdp', 'tensor', 'expert')`` over some of the topology's
    devices (:func:`jax_rl.sharding.make_mesh`, ``placement.rollout`` / ``rollout.mesh``): the engine
    is built as ``Qwen3Engine(..., mesh=mesh)`` and its params / decode state take the engine's own
    shardings (``param_shardings``, ``state_shardings``); both steps are compiled under
    ``jax.set_mesh(mesh)``, as the sharded engine runs them. ``params_per_chip`` and
    ``kv_cache_per_chip`` are then the bytes of one device's shards.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from rollout.engine import Qwen3Engine  # lazy: jax; the CLI imports this module before it chooses the platform

    spec = resolve_topology(topology)
    topo = get_topology(topology)
    kw = dict(scan_layers=True, attention="splash")
    kw.update(model_kwargs or {})
    # kv_per_layer=False: the stacked cache (the CPU-only per-layer form costs bytes on a TPU)
    sharded = mesh is not None
    engine = Qwen3Engine(model_config, slots=slots, max_cache_len=max_cache_len,
                         max_prefill_length=prefill_len, dtype=dtype, model_kwargs=kw, kv_per_layer=False,
                         **({"mesh": mesh} if sharded else {}))
    if not sharded:
        mesh = Mesh(np.array(topo.devices), ("data",))
    rep = NamedSharding(mesh, P())

    def abstract(tree, shardings=None):
        if shardings is None:
            return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), tree)
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)

    progs = engine.programs
    if sharded:
        params = abstract(engine.abstract_params, engine.param_shardings)
        with jax.set_mesh(mesh):
            abs_state = jax.eval_shape(progs["init_state"], engine.abstract_params)
        state = abstract(abs_state, engine.state_shardings)
    else:
        params = abstract(engine.abstract_params)
        state = abstract(jax.eval_shape(progs["init_state"], engine.abstract_params))

    tokens = jax.ShapeDtypeStruct((1, prefill_len), jnp.int32, sharding=rep)
    n = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
    out: dict[str, dict[str, Any]] = {}
    # set_mesh: the splash kernel runs under shard_map on the ambient mesh (a Mosaic kernel
    # cannot be partitioned automatically)
    # decode: no ambient mesh (the engine runs it so; under set_mesh the activation
    # constraints would shard the batch while the replicated cache is donated, and the
    # output cache could not alias the input)
    import contextlib

    # contexts built lazily: jax.set_mesh(mesh) sets the mesh as soon as it is called
    def rows_of(shape, dt):  # the append-prefill's per-row vectors, replicated
        return jax.ShapeDtypeStruct(shape, dt, sharding=rep)

    # append_prefill: an agent turn's new tokens appended to ``slots`` kept K/V rows at once (the
    # largest row bucket), ``prefill_len`` new positions each (Qwen3Engine.programs)
    ext_args = (params, state, rows_of((slots, prefill_len), jnp.int32),
                *(rows_of((slots,), dt) for dt in (jnp.int32, jnp.int32, jnp.int32, jnp.int32, jnp.uint32,
                                                    jnp.float32)))
    steps = {"prefill": (progs["prefill"], (params, tokens, n), lambda: jax.set_mesh(mesh)),
             "append_prefill": (progs["append_prefill"], ext_args,
                                (lambda: jax.set_mesh(mesh)) if sharded else contextlib.nullcontext),
             "decode": (progs["generate"], (params, state),
                        (lambda: jax.set_mesh(mesh)) if sharded else contextlib.nullcontext)}
    import time

    for name, (fn, args, ctx) in steps.items():
        if name not in only:
            continue
        t0 = time.perf_counter()
        with ctx(), jax.default_matmul_precision("default"), no_persistent_cache():
            a = _analysis(fn.lower(*args).compile(compiler_options=compiler_options or None))
        a["compile_s"] = time.perf_counter() - t0
        a["hbm_fraction"] = a["peak_bytes_per_chip"] / spec.chip.hbm_bytes
        out[name] = a
    def nbytes(tree):  # one device's shard of every leaf (replicated: the whole leaf)
        return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))

    dec = out.get("decode")
    if dec is not None:
        dec["params_per_chip"] = nbytes(params)
        dec["kv_cache_per_chip"] = nbytes((state["cache"].k, state["cache"].v))
        dec["bytes_accessed_ratio"] = dec["bytes_accessed"] / (dec["params_per_chip"]
                                                               + dec["kv_cache_per_chip"])
    out["topology"] = {"name": spec.topology_name, "chips": spec.num_chips,
                       "devices": len(topo.devices), "chip": spec.chip.name,
                       "hbm_bytes_per_chip": spec.chip.hbm_bytes}
    return out
