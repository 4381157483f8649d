"""AOT compile of the rollout engine's steps for a TPU topology from a CPU host (:func:`compile_rollout`):
``rollout.engine.Qwen3Engine``'s prefill, append-prefill and decode programs lowered with
``ShapeDtypeStruct`` arguments and compiled through libtpu's compiler (the ``tpu`` extra); returns
``memory_analysis()`` (bytes per chip) and ``cost_analysis()`` figures. These are compile-time estimates:
nothing runs on a TPU, and ``cost_analysis`` counts a loop (e.g. a scanned layer stack) body once. Imports jax
only when called (the CLI imports the package before it chooses the platform)."""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Optional

from jax_rl.tpu.analysis import program_analysis
from jax_rl.tpu.topology import get_topology, no_persistent_cache, resolve_topology

__all__ = ["compile_rollout"]


def compile_rollout(model_config, topology: str, spec: Any, *, prefill_len: int = 1024,
                    only: tuple[str, ...] = ("prefill", "decode"),
                    compiler_options: Optional[dict] = None, mesh: Any = None) -> dict[str, dict[str, Any]]:
    """AOT-compile the prefill (batch 1, ``prefill_len`` tokens), decode step (``spec.slots`` slots,
    ``spec.max_cache_len`` cache) and, in ``only``, the append-prefill of the engine ``spec`` describes
    (a :class:`rollout.engine.EngineSpec`: slots, cache length, dtype, sampler, K/V layout; compiled with
    ``kv_per_layer=False``, the stacked cache, and ``max_prefill_length=prefill_len``) 
    (``"append_prefill"``: ``slots`` rows of ``prefill_len`` new tokens onto kept K/V, an agent
    turn's program; paged: the largest chunked-prefill program, ``Qwen3Engine.kv.append_prefill_shape``) for
    ``topology`` (see ``resolve_topology``), params and state replicated on every chip as the engine places them. ``only``: the steps to compile (each result has ``compile_s``,
    seconds).

    ``spec.model_kwargs`` go to ``Qwen3ForCausalLM`` over the defaults ``scan_layers=True``,
    ``attention="splash"``. Returns ``{"prefill": {...}, "decode": {...}, "topology": {...}}``;
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

    The paged layout (``spec.kv_layout``, ``rollout.kv_layout``): the engine's paged programs
    (``rollout.engine.paged``) over a pool of ``spec.kv_pages`` pages of ``spec.kv_page_size`` positions (None:
    the contiguous layout's memory), its append-prefill the chunked program of ``spec.prefill_chunk_size``
    (the result's ``tokens_shape``), their attention the TPU ragged paged attention kernel
    (:func:`jax_rl.models.backend_target.target_backend`; on ``mesh`` per shard in ``shard_map``);
    ``kv_cache_per_chip`` is then the pool (one chip's shard of it). ``spec.sampler``: ``rollout.sampler``
    (the decode step's untruncated draw: the Pallas kernel or XLA).
    """
    tspec = resolve_topology(topology)
    topo = get_topology(topology)
    engine, mesh, sharded, params, state, rep = _engine_args(model_config, topo, spec, prefill_len, mesh)
    kernel = engine.kv.one_device_kernel  # traced for the TPU (the paged attention kernel)
    out: dict[str, dict[str, Any]] = {}
    ext = engine.kv.append_prefill_shape(prefill_len)  # paged: the chunked prefill's program (rows, positions)
    for name, (fn, args, ctx) in _steps(engine.programs, params, state, rep, mesh, sharded, ext, prefill_len).items():
        if name not in only:
            continue
        out[name] = _compile_step(fn, args, ctx, compiler_options, tspec.chip.hbm_bytes, paged=kernel, mesh=mesh)
        if name == "append_prefill":
            out[name]["tokens_shape"] = list(ext)  # [rows, new positions] of the program compiled
    if "decode" in out:
        _decode_bytes(out["decode"], params, state)
    out["topology"] = {"name": tspec.topology_name, "chips": tspec.num_chips,
                       "devices": len(topo.devices), "chip": tspec.chip.name,
                       "hbm_bytes_per_chip": tspec.chip.hbm_bytes}
    return out


def _engine_args(model_config, topo, spec, prefill_len, mesh):
    """The engine (``kv_per_layer=False``: the stacked cache; the CPU-only per-layer form costs bytes on a TPU),
    its mesh (the topology's devices on one ``data`` axis unless ``mesh`` is given), and its params and
    decode state as ``ShapeDtypeStruct`` (replicated, or the sharded engine's own shardings)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from rollout.engine import Qwen3Engine  # lazy: jax; the CLI imports this module before it chooses the platform

    kw = dict(scan_layers=True, attention="splash")
    kw.update(spec.model_kwargs or {})
    spec = spec.replace(max_prefill_length=prefill_len, model_kwargs=kw, kv_per_layer=False)
    sharded = mesh is not None
    from jax_rl.models.backend_target import target_backend  # lazy: jax

    # the state a TPU engine holds, its shardings included (its K/V, a paged pool or a contiguous cache, in
    # their float dtype: traced for this CPU host they would be their uint16 bits, jax_rl.models.kv_storage)
    with target_backend("tpu"):
        engine = Qwen3Engine(model_config, None, spec, mesh=mesh)
    if not sharded:  # the colocated paged engine is one device's (its kernel unpartitioned): one chip
        mesh = Mesh(np.array(topo.devices[:1] if engine.kv.one_device_kernel else topo.devices), ("data",))
    rep = NamedSharding(mesh, P())

    def abstract(tree, shardings=None):
        if shardings is None:
            return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), tree)
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)

    progs = engine.programs
    if sharded:
        params = abstract(engine.abstract_params, engine.param_shardings)
        with jax.set_mesh(mesh), target_backend("tpu"):
            abs_state = jax.eval_shape(progs["init_state"], engine.abstract_params)
        state = abstract(abs_state, engine.state_shardings)
    else:
        params = abstract(engine.abstract_params)
        with target_backend("tpu"):
            state = abstract(jax.eval_shape(progs["init_state"], engine.abstract_params))
    return engine, mesh, sharded, params, state, rep


def _steps(progs, params, state, rep, mesh, sharded, ext, prefill_len) -> dict:
    """``name -> (program, abstract args, context factory)`` of the engine's prefill, append-prefill and decode.

    Prefill runs under ``jax.set_mesh`` (the splash kernel runs under shard_map on the ambient mesh: a Mosaic
    kernel cannot be partitioned automatically). Decode runs with no ambient mesh unless the engine is sharded
    (the engine runs it so; under set_mesh the activation constraints would shard the batch while the
    replicated cache is donated, and the output cache could not alias the input). The contexts are built
    lazily: ``jax.set_mesh(mesh)`` sets the mesh as soon as it is called."""
    import jax
    import jax.numpy as jnp

    tokens = jax.ShapeDtypeStruct((1, prefill_len), jnp.int32, sharding=rep)
    n = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)

    def rows_of(shape, dt):  # the append-prefill's per-row vectors, replicated
        return jax.ShapeDtypeStruct(shape, dt, sharding=rep)

    # append_prefill: an agent turn's new tokens appended to kept K/V rows at once, ``ext`` = (rows, new
    # positions): the contiguous layout's ``slots`` rows of ``prefill_len`` (the largest row bucket), the paged
    # layout's chunk program (KVLayout.append_prefill_shape)
    ext_args = (params, state, rows_of(ext, jnp.int32),
                *(rows_of((ext[0],), dt) for dt in (jnp.int32, jnp.int32, jnp.int32, jnp.int32, jnp.uint32,
                                                    jnp.float32)))
    return {"prefill": (progs["prefill"], (params, tokens, n), lambda: jax.set_mesh(mesh)),
            "append_prefill": (progs["append_prefill"], ext_args,
                               (lambda: jax.set_mesh(mesh)) if sharded else contextlib.nullcontext),
            "decode": (progs["decode"], (params, state),
                       (lambda: jax.set_mesh(mesh)) if sharded else contextlib.nullcontext)}


def _compile_step(fn, args, ctx, compiler_options: Optional[dict], hbm_bytes: int, paged: bool = False,
                  mesh: Any = None) -> dict[str, Any]:
    """One step lowered and compiled (no persistent cache: ``compile_s`` is a real compile) and its
    :func:`~jax_rl.tpu.analysis.program_analysis` with ``compile_s`` and ``hbm_fraction``; ``paged``:
    traced with the TPU paged attention kernel."""
    import jax

    from jax_rl.models.backend_target import target_backend  # lazy: jax

    t0 = time.perf_counter()
    backend = target_backend("tpu") if paged else contextlib.nullcontext()
    # the paged kernel's lowering reads the TPU generation from the ambient mesh's devices
    ambient = (lambda: jax.set_mesh(mesh)) if paged else ctx
    with ambient(), backend, jax.default_matmul_precision("default"), no_persistent_cache():
        a = program_analysis(fn.lower(*args).compile(compiler_options=compiler_options or None))
    a["compile_s"] = time.perf_counter() - t0
    a["hbm_fraction"] = a["peak_bytes_per_chip"] / hbm_bytes
    return a


def _decode_bytes(dec: dict[str, Any], params, state) -> None:
    """``params_per_chip``, ``kv_cache_per_chip`` (one device's shard of every leaf; replicated: the whole
    leaf) and ``bytes_accessed_ratio`` into the decode step's dict."""
    import jax

    def nbytes(tree):
        return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))

    dec["params_per_chip"] = nbytes(params)
    cache = state["cache"]
    dec["kv_cache_per_chip"] = nbytes(cache.kv if hasattr(cache, "kv") else (cache.k, cache.v))
    dec["bytes_accessed_ratio"] = dec["bytes_accessed"] / (dec["params_per_chip"] + dec["kv_cache_per_chip"])
