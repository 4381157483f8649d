"""The TPU compiler's bytes per decode step, the bitwise mode against the fast mode (issue 62; libtpu AOT from this
CPU host, compiled, never run: no TPU time).

Usage::

    JAX_PLATFORMS=cpu .venv/bin/python bench/bitwise_tpu_bytes.py [--preset qwen3_0p6b] [--layers 4] [--slots 32]
        [--cache 2048] [--topology v5e-4] [--row-tile N] [--json docs/results/bitwise_tpu_bytes.json]

AOT-compiles the contiguous engine's ``decode`` program (one decode step for every slot, bf16, unrolled layers,
params and state replicated, figures per chip) for ``--topology`` twice, ``model_kwargs`` ``attention="xla"`` then
``"bitwise"``, and prints the compiler's ``cost_analysis()['bytes accessed']``, peak bytes per chip and FLOPs of each
and the bitwise / fast ratios (:func:`jax_rl.compile.analysis.program_analysis`). The TPU path of the mode is the same XLA
program as on the CPU (chunked attention, the row tile); the CPU-only compiler option is not passed to libtpu.
``--row-tile N`` compiles the mode with ``jax_rl.models.bitwise.ROW_TILE = N`` (default: the module's).
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
from _record import ROOT  # noqa: E402,F401  (the bench preamble: the repository first on sys.path)


def compile_one(cfg, topology: str, *, slots: int, cache: int, bitwise: bool) -> dict:
    """The analysis dict of one AOT compile of the engine's decode step."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jax_rl.compile.analysis import program_analysis
    from jax_rl.compile.topology import get_topology, no_persistent_cache
    from jax_rl.models.backend_target import target_backend
    from rollout.engine import EngineSpec, Qwen3Engine

    topo = get_topology(topology)
    mesh = Mesh(np.array(topo.devices)[:1], ("data",))
    spec = EngineSpec(slots=slots, max_cache_len=cache, max_prefill_length=16, dtype="bfloat16",
                      model_kwargs=dict(scan_layers=False, attention="bitwise" if bitwise else "xla"),
                      kv_per_layer=False, kv_layout="contiguous")
    with target_backend("tpu"):
        engine = Qwen3Engine(cfg, None, spec)

        def abstract(tree):
            return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, P())),
                                tree)

        params = abstract(engine.abstract_params)
        state = abstract(jax.eval_shape(engine.programs["init_state"], engine.abstract_params))
        t0 = time.perf_counter()
        with jax.default_matmul_precision("default"), no_persistent_cache():
            compiled = engine.programs["decode"].lower(params, state).compile()
    a = program_analysis(compiled)
    a["compile_s"] = round(time.perf_counter() - t0, 1)
    return a


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3_0p6b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--cache", type=int, default=2048)
    ap.add_argument("--topology", default="v5e-4")
    ap.add_argument("--row-tile", type=int, default=0)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    from jax_rl.models import bitwise
    from jax_rl.models.qwen3 import get_preset

    if a.row_tile:
        bitwise.ROW_TILE = a.row_tile

    cfg = get_preset(a.preset, num_hidden_layers=a.layers) if a.layers else get_preset(a.preset)
    res = {m: compile_one(cfg, a.topology, slots=a.slots, cache=a.cache, bitwise=m == "bitwise")
           for m in ("fast", "bitwise")}
    keys = [k for k in ("bytes_accessed", "peak_bytes_per_chip", "flops") if k in res["fast"]]
    out = {"preset": a.preset, "layers": a.layers, "slots": a.slots, "cache": a.cache, "topology": a.topology,
           "row_tile": bitwise.ROW_TILE, "query_tile": bitwise.QUERY_TILE,
           "dtype": "bfloat16", "what": "libtpu AOT compile of the engine's decode step (compiled, not run)",
           **{m: {k: res[m][k] for k in keys + ["compile_s"]} for m in res},
           "ratio_bitwise_over_fast": {k: res["bitwise"][k] / res["fast"][k] for k in keys if res["fast"][k]}}
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            f.write(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
