"""Compile-time memory traffic of one rollout decode step on a TPU topology (libtpu AOT, no TPU).

Usage::

    JAX_PLATFORMS=cpu .venv/bin/python bench/decode_compile.py --preset qwen3_4b --layers 4 \\
        --slots 64 --cache 4096 --topology v5e-4 --scan both --shard slots

AOT-compiles ``Qwen3Engine``'s jitted ``generate`` (one decode step for all slots, the state
donated) for ``--topology`` through libtpu's compiler and prints, per layout, the compiler's
``cost_analysis()['bytes accessed']`` per chip, ``memory_analysis()`` (temporaries, aliased
bytes), the params and KV-cache bytes per chip (from the argument shapes and shardings), and
``ratio = bytes accessed / (params per chip + KV cache per chip)`` (1.0 = every weight and every
cache entry read once). All figures are compile-time estimates, not TPU measurements.

``--shard replicated`` places params and state on every chip (what the engine does today);
``--shard slots`` shards the decode state over the slots axis (params replicated), so a cache
that does not fit one chip can still be compiled.

Loops: ``cost_analysis`` counts a ``while`` body once, so for ``scan_layers=True`` the raw
figure holds one layer. The script also compiles the scanned model with ``jax.lax.scan``
forced to ``unroll=True`` (same stacked params and carried cache, the loop written out) and
reports that figure as the layer-stack total; ``body`` = (unrolled - raw) / (L - 1) is the
per-layer traffic the raw figure counted once.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _per_chip_bytes(tree) -> int:
    import jax

    total = 0
    for a in jax.tree.leaves(tree):
        n = math.prod(a.shape) * a.dtype.itemsize
        shard = a.sharding.shard_shape(a.shape)
        total += n * math.prod(shard) // max(1, math.prod(a.shape))
    return int(total)


def compile_decode(cfg, topology: str, *, slots: int, cache: int, scan: bool, shard: str,
                   unroll_scan: bool = False, dtype: str = "bfloat16") -> dict:
    """AOT-compile the engine's generate step; returns the analysis dict."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jax_rl import tpu
    from rollout.engine import Qwen3Engine

    spec = tpu.resolve_topology(topology)
    topo = tpu.get_topology(topology)
    engine = Qwen3Engine(cfg, slots=slots, max_cache_len=cache, max_prefill_length=16,
                         dtype=dtype, model_kwargs=dict(scan_layers=scan, attention="xla"),
                         kv_per_layer=False)  # a TPU program: the stacked cache
    mesh = Mesh(np.array(topo.devices), ("data",))

    def abstract(tree, spec_fn):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=NamedSharding(mesh, spec_fn(a))), tree)

    params = abstract(engine._abstract_params, lambda a: P())
    state_shapes = jax.eval_shape(engine._init_state_jit, engine._abstract_params)
    if shard == "slots":
        def slot_spec(a):
            if a.ndim == 5:  # cache k/v [L,B,S,K,H]
                return P(None, "data")
            return P("data", *([None] * (a.ndim - 1)))
        state = abstract(state_shapes, slot_spec)
    else:
        state = abstract(state_shapes, lambda a: P())
    kv = state["cache"].k, state["cache"].v
    orig_scan = jax.lax.scan
    if unroll_scan:
        jax.lax.scan = functools.partial(orig_scan, unroll=True)
    try:
        t0 = time.perf_counter()
        # the engine runs without an ambient mesh (its activations carry no constraints);
        # with the state sharded over slots, set the mesh so the activation constraints
        # (activation_batch -> data) shard the batch the same way
        ctx = jax.set_mesh(mesh) if shard == "slots" else contextlib.nullcontext()
        with ctx, jax.default_matmul_precision("default"), tpu.no_persistent_cache():
            lowered = engine._generate_jit.lower(params, state)
            compiled = lowered.compile()
        secs = time.perf_counter() - t0
    finally:
        jax.lax.scan = orig_scan
    a = tpu._analysis(compiled)
    a["compile_s"] = round(secs, 1)
    a["params_per_chip"] = _per_chip_bytes(params)
    a["kv_per_chip"] = _per_chip_bytes(kv)
    a["ratio"] = a["bytes_accessed"] / (a["params_per_chip"] + a["kv_per_chip"])
    a["hbm_fraction"] = a["peak_bytes_per_chip"] / spec.chip.hbm_bytes
    hlo = compiled.as_text()
    a["hlo_while_loops"] = hlo.count(" while(")
    a["hlo_copies"] = sum(1 for ln in hlo.splitlines() if " copy(" in ln or "copy-start(" in ln)
    return a


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="qwen3_4b")
    p.add_argument("--head-dim", type=int, default=0, help="head_dim override (0 = preset)")
    p.add_argument("--layers", type=int, default=0, help="num_hidden_layers override (0 = preset)")
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--cache", type=int, default=4096)
    p.add_argument("--topology", default="v5e-4")
    p.add_argument("--scan", choices=("true", "false", "both"), default="both")
    p.add_argument("--shard", choices=("replicated", "slots"), default="replicated")
    p.add_argument("--no-unroll-check", action="store_true",
                   help="skip the unrolled compile of the scanned layout")
    p.add_argument("--json", default="", help="append one JSON line per result to this file")
    a = p.parse_args(argv)

    from jax_rl.models.qwen3 import get_preset

    over = {"num_hidden_layers": a.layers} if a.layers else {}
    if a.head_dim:
        over["head_dim"] = a.head_dim
    cfg = get_preset(a.preset, **over)
    L = cfg.num_hidden_layers
    scans = {"true": [True], "false": [False], "both": [False, True]}[a.scan]
    gib = 1 << 20  # MiB
    for scan in scans:
        runs = [("raw", False)]
        if scan and not a.no_unroll_check:
            runs.append(("unrolled", True))
        res = {}
        for tag, unroll in runs:
            try:
                res[tag] = compile_decode(cfg, a.topology, slots=a.slots, cache=a.cache,
                                          scan=scan, shard=a.shard, unroll_scan=unroll)
            except Exception as e:  # noqa: BLE001 - report compile failures (e.g. HBM) and go on
                res[tag] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        for tag, r in res.items():
            head = (f"{a.preset} L={L} {a.slots}x{a.cache} {a.topology} shard={a.shard} "
                    f"scan_layers={scan} [{tag}]")
            if "error" in r:
                print(f"{head}: COMPILE FAILED {r['error']}", flush=True)
            else:
                print(f"{head}: bytes_accessed={r['bytes_accessed'] / gib:.3f} MiB "
                      f"params/chip={r['params_per_chip'] / gib:.3f} MiB "
                      f"kv/chip={r['kv_per_chip'] / gib:.3f} MiB ratio={r['ratio']:.2f} "
                      f"temp={r['temp_size_in_bytes'] / gib:.3f} MiB "
                      f"alias={r['alias_size_in_bytes'] / gib:.3f} MiB "
                      f"peak={r['peak_bytes_per_chip'] / gib:.2f} MiB "
                      f"(hbm {r['hbm_fraction']:.2f}) while={r['hlo_while_loops']} "
                      f"copies={r['hlo_copies']} compile={r['compile_s']}s", flush=True)
            if a.json:
                with open(a.json, "a") as f:
                    f.write(json.dumps(dict(preset=a.preset, layers=L, slots=a.slots,
                                            cache=a.cache, topology=a.topology, shard=a.shard,
                                            scan_layers=scan, kind=tag, **r)) + "\n")
        if "raw" in res and "unrolled" in res and "error" not in res["raw"] \
                and "error" not in res["unrolled"] and L > 1:
            body = (res["unrolled"]["bytes_accessed"] - res["raw"]["bytes_accessed"]) / (L - 1)
            print(f"  scanned body (per layer, counted once in raw) = {body / gib:.3f} MiB; "
                  f"layer-stack total = unrolled figure, ratio {res['unrolled']['ratio']:.2f}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
