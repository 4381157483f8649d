"""Where the bitwise mode's cost goes (issue 62): the engine's decode step, its prefill, the learner's forward and
its gradient, fast mode vs bitwise mode and bitwise variants with one piece changed, timed interleaved.

Usage::

    JAX_PLATFORMS=cpu .venv/bin/python bench/bitwise_breakdown.py [--rounds 3] [--reps 5]
        [--variants fast,bitwise,autodiff,emitters,nomat,tile64] [--programs decode,prefill,fwd,grad]
        [--json docs/results/bitwise_breakdown_<date>.json]

Shape: the ``make train`` model (``configs/tiny_cpu.yaml``: tiny_dense, 2 q / 1 kv heads of 64, vocab 640, 2
layers, fp32) and its calls: a paged decode step of ``--slots`` 32 rows over a 128-position cache (pages of 16),
a prefill of 32 rows x 64 tokens, the learner's log-prob forward and ``value_and_grad`` on 64 x 128 tokens.

Variants (each one piece changed against ``bitwise``; programs traced afresh per variant):

- ``fast``: the default mode (``attention="xla"``);
- ``bitwise``: the mode as committed;
- ``autodiff``: the mode with ``CUSTOM_BACKWARD = False`` (the gradient by autodiff through the chunk scan and
  the ``materialize`` conds, the mode before its custom backward rules; forwards unchanged);
- ``noskip``: the mode with ``CAUSAL_SKIP = False`` (every key chunk computed, the masked ones made no-ops by
  ``where``: the mode before the causal skip);
- ``emitters``: the mode with XLA:CPU's default fusion emitters (no ``xla_cpu_use_fusion_emitters=false``);
- ``nomat``: the mode with :func:`jax_rl.models.bitwise.materialize` the identity (no ``lax.cond`` boundaries);
- ``tileN``: the mode with ``ROW_TILE = N``;
- ``qtileN``: the mode with ``QUERY_TILE = N``;
- ``plainattn``: the mode with the attention core a plain masked softmax (not batch-invariant: the chunked
  attention's share of the cost).

Per round every (variant, program) pair runs ``--reps`` calls after a warm-up; the figure is the median call (ms).
Printed per round with the 1-minute load average; the summary is the median over rounds and each variant's ratio
to ``fast``. The numbers are times on a shared host: read them with the load.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_rl.learner.logprobs import sequence_logprobs
from jax_rl.models import bitwise as bw
from jax_rl.models.qwen3 import Qwen3ForCausalLM, get_preset
from jax_rl.models.qwen3.paged import init_paged_cache, paged_decode_step, paged_extend

PS = 16


@contextlib.contextmanager
def variant(name: str):
    """Patches the bitwise module for one variant (restored on exit)."""
    saved = {k: getattr(bw, k) for k in ("ROW_TILE", "QUERY_TILE", "CPU_COMPILER_OPTIONS", "materialize",
                                         "CUSTOM_BACKWARD", "CAUSAL_SKIP")}
    try:
        if name == "autodiff":
            bw.CUSTOM_BACKWARD = False
        elif name == "noskip":
            bw.CAUSAL_SKIP = False
        elif name == "emitters":
            bw.CPU_COMPILER_OPTIONS = {}
        elif name == "nomat":
            bw.materialize = lambda x: x
        elif name == "plainattn":
            import jax_rl.models.paged_attention as pa  # lazy: bench only
            import jax_rl.models.qwen3.model as qm
            saved_attn = (qm.chunked_attend, pa.chunked_attend)
            qm.chunked_attend = pa.chunked_attend = _plain_attend
        elif name.startswith("qtile"):
            bw.QUERY_TILE = int(name[5:])
        elif name.startswith("tile"):
            bw.ROW_TILE = int(name[4:])
        yield
    finally:
        for k, v in saved.items():
            setattr(bw, k, v)
        if name == "plainattn":
            qm.chunked_attend, pa.chunked_attend = saved_attn


def _plain_attend(q, k, v, q_pos, **_):
    """Causal GQA attention, one masked softmax over all keys (the ``plainattn`` variant)."""
    B, T, N, H = q.shape
    K = k.shape[2]
    qh = q.reshape(B, T, K, N // K, H)
    s = jnp.einsum("btkgh,bskh->bkgts", qh, k.astype(q.dtype), preferred_element_type=jnp.float32) * H ** -0.5
    ok = jnp.arange(k.shape[1])[None, None, :] <= jnp.asarray(q_pos)[:, :, None]  # [B,T,S]
    p = jax.nn.softmax(jnp.where(ok[:, None, None], s, -jnp.inf), axis=-1)
    p = jnp.where(ok[:, None, None], p, 0.0)
    o = jnp.einsum("bkgts,bskh->btkgh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(B, T, N, H).astype(q.dtype)


def build(name: str, a) -> dict:
    """The four programs of one variant, compiled, with their arguments: {program: (fn, args)}."""
    cfg = get_preset("tiny_dense", num_attention_heads=2, num_key_value_heads=1, head_dim=64, rope_theta=1e4,
                     vocab_size=640)
    on = name != "fast"
    model = Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32, attention="bitwise" if on else "xla")
    jit = bw.jit if on else jax.jit
    rng = np.random.default_rng(0)
    S, C = a.slots, a.cache
    M = C // PS
    cache = init_paged_cache(model, S, S * M, PS, M).replace(
        page_table=jnp.arange(S * M, dtype=jnp.int32).reshape(S, M))
    ptok = jnp.asarray(rng.integers(1, 640, (S, a.prompt)), jnp.int32)
    prefill = jit(lambda m, t, c: paged_extend(m, t, jnp.zeros((S,), jnp.int32), jnp.full((S,), t.shape[1], jnp.int32),
                                               c).logits)
    filled = jax.jit(lambda m, t, c: paged_extend(m, t, jnp.zeros((S,), jnp.int32),
                                                  jnp.full((S,), t.shape[1], jnp.int32), c).cache)(model, ptok, cache)
    decode = jit(lambda m, t, c: paged_decode_step(m, t, c).logits)
    dtok = jnp.asarray(rng.integers(1, 640, (S,)), jnp.int32)
    ltok = jnp.asarray(rng.integers(1, 640, (a.batch, a.seq)), jnp.int32)
    lmask = jnp.asarray(np.arange(a.seq)[None] < rng.integers(a.seq // 2, a.seq + 1, (a.batch, 1)))
    fwd = jit(lambda m, t, am: sequence_logprobs(m, t, am).logp)
    gdef, state = nnx.split(model)
    adv = jnp.asarray(rng.normal(size=(a.batch, a.seq)), jnp.float32)

    def loss(st, t, am):
        return jnp.sum(sequence_logprobs(nnx.merge(gdef, st), t, am).logp * adv)

    grad = jit(jax.value_and_grad(loss))
    progs = {"decode": (decode, (model, dtok, filled)), "prefill": (prefill, (model, ptok, cache)),
             "fwd": (fwd, (model, ltok, lmask)), "grad": (grad, (state, ltok, lmask))}
    out = {}
    for p in a.programs.split(","):
        fn, args = progs[p]
        compiled = fn.lower(*args).compile()  # traced under the variant's patches
        out[p] = (compiled, args)
    return out


def time_call(fn, args, reps: int) -> tuple[float, float]:
    """Median wall ms and median process-CPU ms (every thread) of ``reps`` calls after one warm-up."""
    jax.block_until_ready(fn(*args))
    ts, cs = [], []
    for _ in range(reps):
        t, c = time.perf_counter(), time.process_time()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
        cs.append(time.process_time() - c)
    return statistics.median(ts) * 1e3, statistics.median(cs) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--variants", default="fast,bitwise,emitters,nomat,tile64")
    ap.add_argument("--programs", default="decode,prefill,fwd,grad")
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--cache", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    names = a.variants.split(",")
    built = {}
    for n in names:
        with variant(n):
            built[n] = build(n, a)
    rows = []
    for r in range(a.rounds):
        for p in a.programs.split(","):
            load = os.getloadavg()[0]
            fig = {n: time_call(*built[n][p], a.reps) for n in names}
            rows.append({"round": r, "program": p, "load": load, "ms": {n: v[0] for n, v in fig.items()},
                         "cpu_ms": {n: v[1] for n, v in fig.items()}})
            print(f"round {r} load {load:4.1f} {p:8s} wall/cpu ms " +
                  "  ".join(f"{n} {v[0]:.1f}/{v[1]:.1f}" for n, v in fig.items()), flush=True)
    summary = {}
    for p in a.programs.split(","):
        summary[p] = {}
        for key in ("ms", "cpu_ms"):
            med = {n: statistics.median(x[key][n] for x in rows if x["program"] == p) for n in names}
            summary[p][f"median_{key}"] = med
            summary[p][f"ratio_to_fast_{key}"] = {n: med[n] / med["fast"] for n in names} if "fast" in med else None
            print(f"{p:8s} {key:6s} " + "  ".join(f"{n} {med[n]:8.2f}" + (f" ({med[n] / med['fast']:.2f}x)"
                                                                          if "fast" in med else "") for n in names))
    if a.json:
        rec = {"date": f"{dt.date.today()}", "jax": jax.__version__, "host": "2-core CPU (shared)",
               "args": vars(a), "summary": summary, "rounds": rows}
        Path(a.json).write_text(json.dumps(rec, indent=1) + "\n")


if __name__ == "__main__":
    main()
