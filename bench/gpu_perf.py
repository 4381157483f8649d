"""Decode tokens/s against the HBM roofline and learner MFU for this checkout, by layout and variant
(issue 37: one short run on one accelerator, e.g. the H200 of the ``device`` tool).

    python bench/gpu_perf.py [decode] [learner] [profile] [--platform gpu] [--out DIR]

Parts (each prints ``FIGURE ...`` lines and appends JSON records to ``DIR/gpu_perf.jsonl``):

- ``decode``: the engine's decode step alone at the Qwen3-0.6B shape (random bf16 weights), for
  ``--slots`` (default 64,256) and each ``--layouts`` (``per_layer``: the engine's default off a TPU,
  unrolled layers with one K/V buffer per layer; ``scan``: stacked params and cache under a layer
  scan, the GPU default before issue 37). Every slot active from ``--prompt`` cached positions,
  ``--new`` tokens per slot in ``decode_steps`` calls of ``--decode-steps`` (prefill and host
  work of the generator excluded; the cache holds zeros, which costs the same as real K/V). The
  roofline per step: all weights once (bf16, the tied LM head once) plus each slot's K/V up to its
  current length, at ``--hbm-bw`` bytes/s (default: the chip's vendor figure, ``jax_rl/compile/chips.py``);
  figures are decode-only tokens/s and % of it. Then the
  end-to-end ``Generator`` figure (prefill included, ``bench/rollout_decode.py``'s runner, the
  engine's default layout) as the shared GPU harness measures it.
- ``learner``: ``Learner.train_step`` (``ppo``, fp32 master, bf16 compute, scan_layers) at B=``--lb``,
  T=``--lt`` for each ``--variants`` entry ``attention:remat_policy`` (default ``xla:none`` = the
  config default, ``cudnn:none``, ``cudnn:save_dot_with_context_except_mlp``,
  ``xla:save_dot_with_context_except_mlp``), each in its own process (so the peak memory is its
  own): s/step, MFU (``bench/learner_step.py``'s FLOP formula) against ``--peak-flops`` (default: the
  chip's dense bf16 vendor peak, ``jax_rl/compile/chips.py``), and the
  device's ``peak_bytes_in_use``.
- ``profile``: a ``jax.profiler`` trace of 8 decode steps (64 slots, default layout) in ``DIR/trace``.

On a CPU (``--platform cpu --tiny``) it runs the small model as a logic check; its figures mean
nothing for an accelerator.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
from _record import ROOT  # noqa: E402,F401  (the bench preamble: the repository first on sys.path)

from _record import PLATFORMS, add_platform_arg, environment  # noqa: E402  (no jax)


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("parts", nargs="*", default=["decode", "learner"])
    add_platform_arg(p)  # default here: JAX_PLATFORMS as set, else JAX's own choice (an accelerator bench)
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu_perf"))
    p.add_argument("--tiny", action="store_true", help="the small bench model (logic check on a CPU)")
    p.add_argument("--slots", default="64,256")
    p.add_argument("--layouts", default="per_layer,scan")
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--hbm-bw", type=float, default=None,
                   help="bytes/s of the decode roofline (default: the chip's vendor figure, jax_rl.compile.chips.CHIPS; "
                        "none on a CPU or an unknown chip)")
    p.add_argument("--peak-flops", type=float, default=None,
                   help="FLOP/s for MFU (default: the chip's dense bf16 vendor peak, jax_rl.compile.chips.CHIPS; e.g. "
                        "790e12, an 8192^3 bf16 matmul measured on the H200, for an attainable-rate MFU)")
    p.add_argument("--lb", type=int, default=8)
    p.add_argument("--lt", type=int, default=2048)
    p.add_argument("--lsteps", type=int, default=4)
    p.add_argument("--chunk", type=int, default=512, help="model.logits_chunk_tokens of the learner")
    p.add_argument("--variants", default="xla:none,cudnn:none,cudnn:save_dot_with_context_except_mlp,"
                                          "xla:save_dot_with_context_except_mlp")
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)  # one learner variant (child process)
    return p.parse_args(argv)


A = None
ENV: dict = {}  # _record.environment(): versions, backend, devices, chip; in every record


def record(part: str, line: str, **fields) -> None:
    os.makedirs(A.out, exist_ok=True)
    with open(os.path.join(A.out, "gpu_perf.jsonl"), "a") as f:
        f.write(json.dumps({"part": part, "line": line, "env": ENV, **fields}, default=str) + "\n")
    print(f"FIGURE [{part}] {line}", flush=True)


def _cfg():
    from jax_rl.models import qwen3 as q

    if A.tiny:
        from rollout_decode import SMALL

        return q.get_preset("tiny_dense", **SMALL)
    return q.get_preset("qwen3_0p6b")


def _roofline(cfg, slots: int, start: int, new: int) -> dict:
    sys.path.insert(0, os.path.join(_HERE))
    from decode_hlo import roofline_bytes

    per_step = [roofline_bytes(cfg, slots, start + i, 2)["total"] for i in range(new)]
    if not A.hbm_bw:  # a CPU or an unknown chip: no roofline
        return dict(step_ms=None, tok_s=None, bytes_per_step=statistics.mean(per_step))
    step_s = statistics.mean(per_step) / A.hbm_bw
    return dict(step_ms=step_s * 1e3, tok_s=slots / step_s, bytes_per_step=statistics.mean(per_step))


def part_decode() -> None:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jax_rl.models import qwen3 as q
    from rollout.engine import Qwen3Engine

    cfg = _cfg()
    model = q.Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                               scan_layers=True)
    params = nnx.state(model, nnx.Param)
    del model
    P, N, n = A.prompt, A.new, A.decode_steps
    print(f"decode: {cfg.num_hidden_layers} layers d={cfg.hidden_size} V={cfg.vocab_size}; jax {jax.__version__} "
          f"{jax.devices()}; prompt {P} new {N} decode_steps {n}", flush=True)
    for slots in [int(s) for s in A.slots.split(",")]:
        rl = _roofline(cfg, slots, P, N)
        for layout in A.layouts.split(","):
            try:
                eng = Qwen3Engine(cfg, params, slots=slots, max_cache_len=P + N + 1, max_prefill_length=16,
                                  dtype="bfloat16", temperature=1.0, model_kwargs=dict(scan_layers=True),
                                  kv_per_layer=(layout == "per_layer"), kv_layout="contiguous")

                def fresh():  # a new state each run: decode_steps donates (consumes) the one it is given
                    st = dict(eng.init_decode_state())
                    st["active"] = jnp.ones_like(st["active"])
                    st["keys"] = jax.vmap(jax.random.PRNGKey)(jnp.arange(slots, dtype=jnp.uint32))
                    st["cache"] = st["cache"].replace(lengths=jnp.full_like(st["cache"].lengths, P))
                    return st

                def run() -> float:
                    st = fresh()
                    jax.block_until_ready(st)
                    t = time.perf_counter()
                    data = None
                    for _ in range(N // n):
                        st, data = eng.decode_steps(eng.params, st, n)
                    jax.block_until_ready(data)
                    return slots * (N // n) * n / (time.perf_counter() - t)

                t0 = time.perf_counter()
                run()
                warm = time.perf_counter() - t0
                xs = [run() for _ in range(A.rounds)]
                med = statistics.median(xs)
                beside = (f" = {med / rl['tok_s']:.1%} of the decode roofline {rl['tok_s']:,.0f} tok/s "
                          f"({rl['step_ms']:.3f} ms/step at {A.hbm_bw / 1e12:.2f} TB/s)") if rl["tok_s"] else ""
                record("decode", f"decode-only {layout} slots={slots} P={P} new={N} ds{n}: {med:,.0f} tok/s "
                                 f"[{min(xs):,.0f}-{max(xs):,.0f}], {slots / med * 1e3:.3f} ms/step{beside}; "
                                 f"warm-up {warm:.1f}s",
                       layout=layout, slots=slots, tok_s=xs, roofline=rl)
                eng = None  # free its buffers before the next engine
            except Exception as e:  # noqa: BLE001
                import traceback

                traceback.print_exc()
                record("decode", f"decode-only {layout} slots={slots} FAILED: {type(e).__name__}: {str(e)[:300]}")
        try:  # end to end through the Generator (prefill + host loop), the default layout
            from rollout_decode import ours_runner

            fn = ours_runner(cfg, params, slots, P, N, "bfloat16", True, n)
            fn()
            xs = [fn() for _ in range(A.rounds)]
            record("decode", f"Generator end-to-end (default layout, prefill included) slots={slots} P={P} new={N} "
                             f"ds{n}: {statistics.median(xs):,.0f} tok/s [{min(xs):,.0f}-{max(xs):,.0f}]",
                   slots=slots, tok_s=xs)
        except Exception as e:  # noqa: BLE001
            record("decode", f"Generator end-to-end slots={slots} FAILED: {type(e).__name__}: {str(e)[:300]}")


def part_profile() -> None:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jax_rl.models import qwen3 as q
    from rollout.engine import Qwen3Engine

    cfg = _cfg()
    model = q.Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, scan_layers=True)
    eng = Qwen3Engine(cfg, nnx.state(model, nnx.Param), slots=64, max_cache_len=A.prompt + A.new + 1,
                      max_prefill_length=16, dtype="bfloat16", model_kwargs=dict(scan_layers=True), kv_layout="contiguous")
    st = eng.init_decode_state()
    st["active"] = jnp.ones_like(st["active"])
    st["cache"] = st["cache"].replace(lengths=jnp.full_like(st["cache"].lengths, A.prompt))
    st, d = eng.decode_steps(eng.params, st, 4)
    jax.block_until_ready(d)
    path = os.path.join(A.out, "trace")
    with jax.profiler.trace(path):
        for _ in range(2):
            st, d = eng.decode_steps(eng.params, st, 4)
        jax.block_until_ready(d)
    record("profile", f"jax.profiler trace of 8 decode steps (64 slots, default layout) in {path}")


def _learner_variant(variant: str) -> None:
    import jax
    import numpy as np

    from jax_rl.config import Config
    from jax_rl.learner.learner import Learner
    from learner_step import _batch, step_flops

    attention, remat = variant.split(":")
    preset = ({"preset": "tiny_dense", "hf_overrides": __import__("rollout_decode").SMALL} if A.tiny
              else {"preset": "qwen3_0p6b"})
    model = {**preset, "dtype": "bfloat16", "scan_layers": True, "logits_chunk_tokens": A.chunk,
             "attention": attention, "remat_policy": remat}
    B, T = A.lb, A.lt
    cfg = Config.model_validate({
        "model": model, "loss": {"correction": "ppo"},
        "optim": {"batch_size": B, "max_seq_len": T, "lr": 1e-4},
        "algo": {"group_size": 1},
        "rollout": {"max_cache_len": T, "max_prefill_length": min(T, 256)},
        "mesh": {"data": 1, "fsdp": 1, "tensor": 1, "expert": 1},
    })
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1, 1), ("data", "fsdp", "tensor", "expert"))
    lrn = Learner(cfg, mesh=mesh)
    mc = lrn.model_config
    b = _batch(mc.vocab_size, B, T)
    t0 = time.perf_counter()
    lrn.train_step(b)
    compile_s = time.perf_counter() - t0
    walls = []
    for _ in range(A.lsteps):
        b["versions"] = np.where(b["loss_mask"], lrn.version, -1).astype(np.int32)
        t0 = time.perf_counter()
        lrn.train_step(b)
        walls.append(time.perf_counter() - t0)
    dt = statistics.median(walls)
    flops = step_flops(mc, B * T, T)
    st = {}
    try:
        st = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001
        pass
    peak = st.get("peak_bytes_in_use", 0) / 2 ** 30
    beside = f" = MFU {flops / dt / A.peak_flops:.1%} of {A.peak_flops / 1e12:.0f}" if A.peak_flops else ""
    record("learner", f"Learner.train_step ppo attention={attention} remat={remat} B={B} T={T}: {dt:.4f} s/step "
                      f"[{min(walls):.4f}-{max(walls):.4f}], {flops / dt / 1e12:.1f} TFLOP/s{beside}; "
                      f"peak mem {peak:.1f} GiB; "
                      f"compile {compile_s:.1f}s", variant=variant, step_s=walls, flops=flops, peak_gib=peak)


def part_learner() -> None:
    for v in A.variants.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), "--variant", v, "--out", A.out, "--lb", str(A.lb),
               "--lt", str(A.lt), "--lsteps", str(A.lsteps), "--chunk", str(A.chunk),
               ] + (["--peak-flops", str(A.peak_flops)] if A.peak_flops else []) + (["--tiny"] if A.tiny else []) + (
            ["--platform", A.platform] if A.platform else [])
        r = subprocess.run(cmd)
        if r.returncode:
            record("learner", f"variant {v} FAILED (exit {r.returncode}; its traceback is above)")


def main(argv=None) -> int:
    global A
    global ENV
    A = _args(argv)
    if A.platform:
        os.environ["JAX_PLATFORMS"] = PLATFORMS[A.platform]
    # the bench modules imported later default JAX_PLATFORMS to cpu when it is unset: pin "auto" first
    os.environ.setdefault("JAX_PLATFORMS", "")
    ENV = environment(echo=not A.variant)  # versions, backend, devices and the chip's vendor peaks
    A.hbm_bw = A.hbm_bw or ENV.get("hbm_bandwidth")
    A.peak_flops = A.peak_flops or ENV.get("peak_bf16_flops")
    if A.variant:
        _learner_variant(A.variant)
        return 0
    print(f"gpu_perf: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; decode roofline at "
          f"{A.hbm_bw or 0:.3g} B/s, MFU against {A.peak_flops or 0:.3g} FLOP/s (0: none, not an accelerator)",
          flush=True)
    parts = {"decode": part_decode, "learner": part_learner, "profile": part_profile}
    for name in A.parts:
        t0 = time.perf_counter()
        try:
            parts[name]()
        except Exception as e:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            record(name, f"FAILED: {type(e).__name__}: {str(e)[:300]}")
        print(f"part {name} done in {time.perf_counter() - t0:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
