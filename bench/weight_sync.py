"""Publish time (learner params -> rollout engines) of the embedded runtime, on this host.

Usage::

    .venv/bin/python bench/weight_sync.py [--sizes tiny,small,medium] [--dtypes bfloat16,float32]
        [--threads 1] [--rounds 5]
    .venv/bin/python bench/weight_sync.py --processes 2 [--mode disagg|colocated] [--sizes tiny,small]

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

``--processes 2``: the multi-process sync instead (:mod:`jax_rl.weight_sync`, no full gather): two jax
processes on 127.0.0.1 (gloo, 2 fake CPU devices each; the worker is ``tests/runtime/ws_worker.py``),
``--mode disagg`` (learner fsdp 2 on process 0, one engine tensor 2 on process 1: every shard crosses)
or ``colocated`` (learner fsdp 4 over both, one single-device engine per process). Prints, per size, the
median [min-max] push seconds (``--rounds``, the first, which compiles, left out) on each process and
the bytes each process staged (learner side, in the engine's layout), sent and received per push, the
most any one device staged, and the full params in ``rollout.dtype`` for scale.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
from _record import ROOT  # noqa: E402,F401  (the bench preamble: the repository first on sys.path)

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


def measure_multiprocess(size: str, mode: str, rounds: int, tmp: str) -> dict:
    """Two ``tests.runtime.ws_worker`` processes; returns their JSON results by process."""
    import json
    import socket
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    outs = [os.path.join(tmp, f"{size}-{mode}-p{p}.json") for p in (0, 1)]
    procs = [subprocess.Popen([sys.executable, "-m", "tests.runtime.ws_worker", str(p), str(port), mode, outs[p],
                               str(rounds + 1)] + ([SIZES[size]] if SIZES[size] != "{}" else []), cwd=root, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for p in (0, 1)]
    logs = [p.communicate(timeout=900)[0] for p in procs]
    for p, log_ in zip(procs, logs):
        if p.returncode != 0:
            raise RuntimeError(f"worker failed: {log_[-2000:]}")
    return {p: json.load(open(outs[p])) for p in (0, 1)}


def main_multiprocess(a) -> None:
    print(f"multi-process weight sync (jax_rl.weight_sync, {a.mode}): 2 processes x 2 fake CPU devices on 127.0.0.1, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; push s: median [min-max] of {a.rounds} (after a "
          "compiling first); bytes per push and process")
    print(f"{'size':8} {'proc':>4} {'push ms':>22} {'staged KiB':>11} {'max/device KiB':>15} {'sent KiB':>9} "
          f"{'recv KiB':>9} {'full KiB':>9}")
    import tempfile as _t

    with _t.TemporaryDirectory() as tmp:
        for size in a.sizes.split(","):
            r = measure_multiprocess(size, a.mode, a.rounds, tmp)
            for p in (0, 1):
                rs = r[p]["rounds"][1:]
                last = rs[-1]
                print(f"{size:8} {p:>4} {_fmt([x['s'] for x in rs]):>22} {last['weight_sync_staged_bytes'] / 1024:11.1f} "
                      f"{last['weight_sync_staged_max_device_bytes'] / 1024:15.1f} {last['weight_sync_sent_bytes'] / 1024:9.1f} "
                      f"{last['weight_sync_recv_bytes'] / 1024:9.1f} {r[p]['full_bytes'] / 1024:9.1f}", flush=True)
    print(f"load after: {os.getloadavg()[0]:.1f}")


def _fmt(xs: list) -> str:
    ms = [1e3 * x for x in xs]
    return f"{statistics.median(ms):8.1f} [{min(ms):.1f}-{max(ms):.1f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="tiny,small,medium")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--threads", type=int, default=1, help="rollout.threads: engines published to")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--processes", type=int, default=1, choices=(1, 2),
                    help="2: the multi-process shard-by-shard sync (jax_rl.weight_sync)")
    ap.add_argument("--mode", default="disagg", choices=("disagg", "colocated"), help="with --processes 2")
    a = ap.parse_args()
    if a.processes == 2:
        return main_multiprocess(a)
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
