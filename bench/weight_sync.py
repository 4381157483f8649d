"""Publish time (learner params -> rollout engines) of the embedded runtime, on this host.

Usage::

    .venv/bin/python bench/weight_sync.py [--sizes tiny,small,medium] [--dtypes bfloat16,float32]
        [--threads 1] [--rounds 5]

For each model size and rollout dtype, builds the run's own objects (``RunContext``: the
learner with its fp32 params; ``EmbeddedProducer``: ``--threads`` started generators over
``Qwen3Engine``), then calls ``EmbeddedProducer.publish`` ``--rounds`` times (no rollout
running) and prints the ``weight_sync_s`` / ``weight_sync_cast_s`` the producer logs for each
publish (median [min-max], milliseconds): the learner's param copy, then every engine's
``load_params`` (cast to the rollout dtype, placement on the engine's device; on the CPU a
``scan_layers`` learner's stacked params are also unstacked for the engine's unrolled copy),
each blocked with ``jax.block_until_ready``. A first publish (warm-up) is not counted. The
machine's load is printed before and after; sizes:

- ``tiny``: ``configs/tiny_cpu.yaml``'s model (d=64, 2 layers, V=640);
- ``small``: V=1024, d=256, 4 layers, 8/4 heads of 32, ff=768 (bench/rollout_decode.py's);
- ``medium``: V=32768, d=1024, 8 layers, 16/8 heads of 64, ff=3072 (~134 M params).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SIZES = {
    "tiny": "{}",
    "small": "{vocab_size: 1024, hidden_size: 256, intermediate_size: 768, num_hidden_layers: 4, "
             "num_attention_heads: 8, num_key_value_heads: 4, head_dim: 32}",
    "medium": "{vocab_size: 32768, hidden_size: 1024, intermediate_size: 3072, num_hidden_layers: 8, "
              "num_attention_heads: 16, num_key_value_heads: 8, head_dim: 64}",
}


def measure(size: str, dtype: str, threads: int, rounds: int, tmp: str) -> dict:
    import jax

    from jax_rl.config import CONFIG_DIR, load_config
    from jax_rl.runtime.context import RunContext
    from jax_rl.runtime.embedded import EmbeddedProducer

    over = ["model.tokenizer=compact", f"rollout.dtype={dtype}", f"rollout.threads={threads}",
            "logging.tensorboard=false", f"run.dir={tmp}/{size}-{dtype}"]
    if SIZES[size] != "{}":
        over.append(f"model.hf_overrides={SIZES[size]}")
    cfg = load_config(CONFIG_DIR / "tiny_cpu.yaml", over)
    ctx = RunContext(cfg)
    prod = None
    try:
        prod = EmbeddedProducer(ctx)
        n = sum(int(x.size) for x in jax.tree.leaves(ctx.learner.state.params))
        v = int(ctx.learner.version)
        prod.publish(v)  # warm-up (first dispatch of every op)
        prod.weight_sync.row()
        tot, cast = [], []
        for _ in range(rounds):
            prod.publish(v)
            r = prod.weight_sync.row()
            tot.append(r["weight_sync_s"])
            cast.append(r["weight_sync_cast_s"])
        return {"params": n, "total": tot, "cast": cast}
    finally:
        if prod is not None:
            prod.stop()
        ctx.close()
        ctx.learner.close()


def _fmt(xs: list) -> str:
    ms = [1e3 * x for x in xs]
    return f"{statistics.median(ms):8.1f} [{min(ms):.1f}-{max(ms):.1f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="tiny,small,medium")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--threads", type=int, default=1, help="rollout.threads: engines published to")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    import jax

    print(f"weight sync (embedded publish) on {jax.devices()[0].platform}, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}; {a.threads} engine(s); median [min-max] of {a.rounds} publishes, ms; "
          "one process, sizes run one after the other")
    print(f"{'size':8} {'dtype':9} {'params':>12} {'fp32 MiB':>9} {'weight_sync_s':>24} {'of it cast':>24}")
    with tempfile.TemporaryDirectory() as tmp:
        for size in a.sizes.split(","):
            for dt in a.dtypes.split(","):
                t0 = time.perf_counter()
                r = measure(size, dt, a.threads, a.rounds, tmp)
                print(f"{size:8} {dt:9} {r['params']:12,d} {r['params'] * 4 / 2**20:9.1f} {_fmt(r['total']):>24} "
                      f"{_fmt(r['cast']):>24}   ({time.perf_counter() - t0:.0f} s incl. setup)", flush=True)
    print(f"load after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
