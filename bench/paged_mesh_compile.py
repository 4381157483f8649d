"""Compile-time figures of the rollout engine's decode step, contiguous and paged K/V, colocated (one
chip), sharded on a tensor mesh, and on a mesh that also splits the slots (``--data`` / ``--expert``:
the paged pool's pages split over those axes, a sub-pool per shard of slots) (issue 46: the paged
engine on a rollout mesh), through libtpu's compiler for a TPU topology (AOT from this CPU host, no TPU).

Usage::

    JAX_PLATFORMS=cpu .venv/bin/python bench/paged_mesh_compile.py --topology v5p-8 --layers 4 \\
        --slots 64 --cache 2048 --tensor 2 [--expert 2] [--data 2] [--hbm-side]

For each (engine placement, K/V layout) it prints what :func:`jax_rl.tpu.compile_rollout` reports for
the ``generate`` program: params and K/V bytes per chip (from the arguments' shardings; the paged pool
defaults to the contiguous layout's memory, ``slots x max_cache_len`` positions), ``bytes_accessed`` per
chip (``cost_analysis``; with ``--hbm-side`` memory-space assignment is off, every buffer in HBM:
the compiler's HBM-side count), their ratio, and peak HBM per chip. Layers are unrolled
(``scan_layers=False``) so the loop is not counted once. ``cost_analysis`` does not see inside the
paged attention kernel (a Mosaic call): compare the paged rows with each other (colocated vs
sharded), not with the contiguous ones. Compile-time estimates, never TPU measurements.
"""

from __future__ import annotations

import argparse
import datetime


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--topology", default="v5p-8")
    p.add_argument("--preset", default="qwen3_0p6b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--cache", type=int, default=2048)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--tensor", type=int, default=2)
    p.add_argument("--data", type=int, default=1, help="with --expert: a third mesh, data x tensor x expert")
    p.add_argument("--expert", type=int, default=1, help="with --data: a third mesh, data x tensor x expert")
    p.add_argument("--hbm-side", action="store_true", help="compile with memory-space assignment off")
    a = p.parse_args()

    from jax_rl import tpu  # lazy: jax after argparse
    from jax_rl.models import qwen3 as q
    from jax_rl.sharding import make_mesh
    from rollout.engine import EngineSpec

    topo = tpu.get_topology(a.topology)
    mc = q.get_preset(a.preset).replace(num_hidden_layers=a.layers)
    meshes = [("colocated", None),
              (f"tensor {a.tensor}", make_mesh(data=1, fsdp=1, tensor=a.tensor, devices=topo.devices[:a.tensor]))]
    n = a.data * a.tensor * a.expert
    if n > a.tensor:  # the slots (and a paged pool's pages) split over data x expert too
        meshes.append((f"data {a.data} x tensor {a.tensor} x expert {a.expert}",
                       make_mesh(data=a.data, fsdp=1, tensor=a.tensor, expert=a.expert, devices=topo.devices[:n])))
    print(f"# {a.topology}, {a.preset} x {a.layers} layers, {a.slots} slots x {a.cache}, bf16, "
          f"{'HBM-side (MSA off)' if a.hbm_side else 'default compile'}, {datetime.date.today()}")
    print("| engine | K/V | params MiB/chip | K/V MiB/chip | bytes accessed MiB/chip | ratio | peak MiB/chip |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for name, mesh in meshes:
        for layout in ("contiguous", "paged"):
            spec = EngineSpec(slots=a.slots, max_cache_len=a.cache, dtype="bfloat16",
                              model_kwargs=dict(scan_layers=False), kv_layout=layout, kv_page_size=a.page_size)
            d = tpu.compile_rollout(mc, a.topology, spec, prefill_len=256, only=("decode",), mesh=mesh,
                                    compiler_options=tpu.HBM_SIDE_OPTIONS if a.hbm_side else None)["decode"]
            mib = lambda k: f"{d[k] / 2**20:,.1f}"  # noqa: E731
            print(f"| {name} | {layout} | {mib('params_per_chip')} | {mib('kv_cache_per_chip')} | "
                  f"{mib('bytes_accessed')} | {d['bytes_accessed_ratio']:.2f} | {mib('peak_bytes_per_chip')} |",
                  flush=True)


if __name__ == "__main__":
    main()
