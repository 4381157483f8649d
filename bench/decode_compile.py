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
figure holds one layer. The script also compiles the scanned model with
``model.scan_unroll=full`` (same stacked params and carried cache, the loop written out) and
reports that figure as the layer-stack total; ``body`` = (unrolled - raw) / (L - 1) is the
per-layer traffic the raw figure counted once.

VMEM staging: libtpu's memory-space assignment (MSA) prefetches weights and small buffers from
HBM into the chip's VMEM with async copies and slices before the fusions that read them, and
``cost_analysis`` counts every access in every memory space: a prefetched weight is read from HBM
by the copy, written to VMEM, then read from VMEM by the dot (three accesses, one of them HBM), and
q/k/v weights stored ``[D, N, H]`` are also relaid out in VMEM as ``[N*H, D]`` for the MXU. So the
script compiles the loop-free program once more with ``xla_msa_enable=false`` (same HLO passes up
to MSA, hence the same fusions; every buffer in HBM) and reports that ``ratio`` as the HBM-side
count (``--no-msa-check`` skips it). It is the compiler's own count of HBM accesses for that
program, not a TPU measurement; the default compile, with its VMEM copies, is what runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
from _record import ROOT  # noqa: E402,F401  (the bench preamble: the repository first on sys.path)


def _per_chip_bytes(tree) -> int:
    import jax

    total = 0
    for a in jax.tree.leaves(tree):
        n = math.prod(a.shape) * a.dtype.itemsize
        shard = a.sharding.shard_shape(a.shape)
        total += n * math.prod(shard) // max(1, math.prod(a.shape))
    return int(total)


def compile_decode(cfg, topology: str, *, slots: int, cache: int, scan: bool, shard: str,
                   unroll_scan: bool = False, dtype: str = "bfloat16", top: int = 0,
                   compiler_options: dict | None = None) -> dict:
    """AOT-compile the engine's decode step; returns the analysis dict (with ``top`` > 0,
    ``traffic``: ``bench/hlo_traffic.py``'s report of the compiled module, its ``top``
    instructions by the bytes they read and write)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jax_rl import compile as aot
    from jax_rl.models.backend_target import target_backend
    from rollout.engine import EngineSpec, Qwen3Engine

    spec = aot.resolve_topology(topology)
    topo = aot.get_topology(topology)
    engine_spec = EngineSpec(slots=slots, max_cache_len=cache, max_prefill_length=16, dtype=dtype,
                             model_kwargs=dict(scan_layers=scan, attention="xla",
                                               scan_unroll="full" if unroll_scan else 1),
                             kv_per_layer=False, kv_layout="contiguous")  # a TPU program: the stacked cache
    engine = Qwen3Engine(cfg, None, engine_spec)
    mesh = Mesh(np.array(topo.devices), ("data",))

    def abstract(tree, spec_fn):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=NamedSharding(mesh, spec_fn(a))), tree)

    params = abstract(engine.abstract_params, lambda a: P())
    with target_backend("tpu"):  # a TPU engine's state: a bf16 cache as bf16 (this CPU host would keep its bits)
        state_shapes = jax.eval_shape(engine.programs["init_state"], engine.abstract_params)
    if shard == "slots":
        def slot_spec(a):
            if a.ndim == 5:  # cache k/v [L,B,S,K,H]
                return P(None, "data")
            return P("data", *([None] * (a.ndim - 1)))
        state = abstract(state_shapes, slot_spec)
    else:
        state = abstract(state_shapes, lambda a: P())
    kv = state["cache"].k, state["cache"].v
    t0 = time.perf_counter()
    # the engine runs without an ambient mesh (its activations carry no constraints);
    # with the state sharded over slots, set the mesh so the activation constraints
    # (activation_batch -> data) shard the batch the same way
    ctx = jax.set_mesh(mesh) if shard == "slots" else contextlib.nullcontext()
    with ctx, jax.default_matmul_precision("default"), aot.no_persistent_cache():
        lowered = engine.programs["decode"].lower(params, state)
        compiled = lowered.compile(compiler_options=compiler_options or None)
    secs = time.perf_counter() - t0
    a = aot.program_analysis(compiled)
    a["compile_s"] = round(secs, 1)
    a["params_per_chip"] = _per_chip_bytes(params)
    a["kv_per_chip"] = _per_chip_bytes(kv)
    a["ratio"] = a["bytes_accessed"] / (a["params_per_chip"] + a["kv_per_chip"])
    a["hbm_fraction"] = a["peak_bytes_per_chip"] / spec.chip.hbm_bytes
    hlo = compiled.as_text()
    a["hlo_while_loops"] = hlo.count(" while(")
    a["hlo_copies"] = sum(1 for ln in hlo.splitlines() if " copy(" in ln or "copy-start(" in ln)
    a["hlo_dot_fusions"] = sum(1 for ln in hlo.splitlines() if " fusion(" in ln and "kind=kOutput" in ln)
    if top:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import hlo_traffic

        a["traffic"] = hlo_traffic.report(hlo_traffic.top_level_traffic(hlo), top, None)
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
    p.add_argument("--no-msa-check", action="store_true",
                   help="skip the compile with memory-space assignment off (the HBM-side count)")
    p.add_argument("--top", type=int, default=0,
                   help="also list each compile's N heaviest HLO instructions by bytes read + written "
                        "(bench/hlo_traffic.py's top-level traffic)")
    a = p.parse_args(argv)

    from jax_rl import compile as aot
    from jax_rl.models.qwen3 import get_preset

    over = {"num_hidden_layers": a.layers} if a.layers else {}
    if a.head_dim:
        over["head_dim"] = a.head_dim
    cfg = get_preset(a.preset, **over)
    L = cfg.num_hidden_layers
    scans = {"true": [True], "false": [False], "both": [False, True]}[a.scan]
    gib = 1 << 20  # MiB
    for scan in scans:
        runs = [("raw", False, None)]
        if scan and not a.no_unroll_check:
            runs.append(("unrolled", True, None))
        if not a.no_msa_check:  # the loop-free program again, VMEM placement off (see module doc)
            runs.append(("msa off", scan and not a.no_unroll_check, aot.HBM_SIDE_OPTIONS))
        res = {}
        for tag, unroll, opts in runs:
            try:
                res[tag] = compile_decode(cfg, a.topology, slots=a.slots, cache=a.cache,
                                          scan=scan, shard=a.shard, unroll_scan=unroll, top=a.top,
                                          compiler_options=opts)
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
                      f"copies={r['hlo_copies']} output_fusions={r['hlo_dot_fusions']} compile={r['compile_s']}s", flush=True)
            for line in r.pop("traffic", []):
                print("    " + line, flush=True)
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
        whole = res.get("unrolled") if scan and not a.no_unroll_check else res.get("raw")
        off = res.get("msa off")
        if whole and off and "error" not in whole and "error" not in off:
            print(f"  HBM-side count (memory-space assignment off, same program): ratio {off['ratio']:.2f}; "
                  f"the VMEM staging of the default compile adds "
                  f"{(whole['bytes_accessed'] - off['bytes_accessed']) / gib:.1f} MiB "
                  f"({whole['ratio']:.2f} -> {off['ratio']:.2f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
