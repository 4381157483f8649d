"""The CPU paged prefill with and without the causal block skip (issue 61 item 6).

Usage::

    taskset -c 0 nice -n 10 .venv/bin/python bench/paged_prefill_skip.py [--chunks 2048,512] [--rounds 3]
        [--prompt 2048] [--mixed 130,300,520,700,1100,1500,1900,2048] [--json docs/results/paged_prefill_skip_DATE.json]

The paged engine's append-prefill on XLA:CPU (``jax_rl.models.paged_attention.paged_attention_xla``) used to
score every query of a chunk against every key of its page bucket (``attend``'s [T, S] scores): the keys
above the causal diagonal (a chunk at position p attends to keys ``0 .. p + T``, in a bucket of up to twice
that) and the queries past a padded row's length. With the skip
(:func:`jax_rl.models.xla_attention.attend_offsets`) each block of ``Q_BLOCK`` queries runs an online softmax
over key blocks of ``K_BLOCK`` up to its traced frontier only.

Two workloads on the tau2 retail model (``bench/paged_cpu.py``'s: tiny_dense with 2 q heads, 1 kv head of 64,
vocab 1,024; bf16; ``--slots`` 8, ``--cache`` positions): ``single``, one fresh ``--prompt``-token prompt;
``mixed``, one fresh prompt per slot of the ``--mixed`` lengths. Per ``rollout.prefill_chunk_size`` of
``--chunks`` two engines are built: ``before`` (the skip replaced by the old ``attend`` over the [T, S] mask
while it is traced, i.e. today's main) and ``after``; each is warmed on both workloads (every program
compiled), then ``--rounds`` rounds time each (engine, workload) in turn, interleaved (the host's load
swings): the slots freed and the whole ``prefill_slots`` call timed on new random prompts (no prefix hit).

Also printed, per workload and chunk size, from the engine's own chunk plan: the query-key pairs scored per
layer and kv head (every row of every program, padding rows included) before, after, and the causal minimum
(each valid query's position + 1).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import time

from _record import ROOT, finish  # noqa: F401  (the bench preamble: the repository first on sys.path)


@contextlib.contextmanager
def unskipped():
    """Trace the paged prefill with today's main's attention (``attend`` over the full [T, S] causal mask)."""
    from jax_rl.models import paged_attention as pa
    from jax_rl.models.xla_attention import attend
    import jax.numpy as jnp

    def old(q, k, v, starts, lengths):
        pos = starts[:, None] + jnp.arange(q.shape[1], dtype=jnp.int32)[None]
        return attend(q, k, v, jnp.arange(k.shape[1], dtype=jnp.int32)[None, None, :] <= pos[:, :, None])

    saved = pa.attend_offsets
    pa.attend_offsets = old
    try:
        yield
    finally:
        pa.attend_offsets = saved


def build(chunk: int, a):
    from flax import nnx

    from jax_rl.models import qwen3 as q
    from rollout.engine import Qwen3Engine

    cfg = q.get_preset("tiny_dense", num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                       rope_theta=10000.0, vocab_size=1024)
    params = nnx.state(q.Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    return Qwen3Engine(cfg, params, slots=a.slots, max_cache_len=a.cache, max_prefill_length=a.cache,
                       dtype="bfloat16", temperature=1.0, kv_layout="paged", prefill_chunk_size=chunk)


def workloads(a) -> dict[str, list[int]]:
    return {"single": [a.prompt], "mixed": [int(x) for x in a.mixed.split(",")]}


def prefill(eng, lengths: list[int], seed: int, state=None):
    """Every slot freed, then ``prefill_slots`` of fresh random prompts of ``lengths``: (state, seconds)."""
    import jax
    import numpy as np

    from rollout.engine.slots import SlotPrefill

    rng = np.random.default_rng(seed)
    state = eng.init_decode_state() if state is None else eng.free_slots(state, range(eng._slots))
    rows = [SlotPrefill(tokens=list(map(int, rng.integers(1, 1024, n + 1))), slot=i, seed=i)
            for i, n in enumerate(lengths)]
    jax.block_until_ready(state)
    t = time.perf_counter()
    state, _ = eng.prefill_slots(eng.params, state, rows)
    jax.block_until_ready(state)
    return state, time.perf_counter() - t


def pairs_scored(lengths: list[int], chunk: int, a) -> dict[str, int]:
    """Query-key pairs scored per layer and kv head group by the engine's chunk plan (prompts of ``lengths``
    computed from 0): ``before`` T x S for every row of every program, ``after`` each query block's rows
    times its key blocks up to the frontier, ``needed`` the causal minimum."""
    from jax_rl.models.paged_attention import page_bucket, pages_for
    from jax_rl.models.xla_attention import K_BLOCK, Q_BLOCK
    from rollout.engine.paged.prefill_plan import prefill_programs

    ps, M = 16, pages_for(a.cache, 16)
    plan = prefill_programs([(i, 0, n, 0) for i, n in enumerate(lengths)], chunk=chunk, slots=a.slots,
                            max_len=a.cache, page_key=lambda end: page_bucket(pages_for(end, ps), M))
    out = {"programs": len(plan), "before": 0, "after": 0, "needed": 0}
    for p in plan:
        S = p.pages * ps
        bk = min(K_BLOCK, S)
        out["before"] += p.rows * p.T * S
        for qa in range(0, p.T, Q_BLOCK):
            qb = min(p.T, qa + Q_BLOCK)
            front = max([c.start + min(qb, c.length) for c in p.chunks if c.length > qa] or [0])
            out["after"] += p.rows * (qb - qa) * min(S, -(-front // bk) * bk)
        out["needed"] += sum(c.start * c.length + c.length * (c.length + 1) // 2 for c in p.chunks)
    return out


def main(argv=None) -> int:
    import jax

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", default="2048,512")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--mixed", default="130,300,520,700,1100,1500,1900,2048")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--cache", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    load0 = os.getloadavg()
    print(f"jax {jax.__version__} {jax.default_backend()}; load {load0}", flush=True)
    chunks = [int(c) for c in a.chunks.split(",")]
    work = workloads(a)
    counts = {f"{w}/chunk{c}": pairs_scored(ls, c, a) for c in chunks for w, ls in work.items()}
    for k, v in counts.items():
        print(f"{k}: {v['programs']} programs; pairs scored before {v['before'] / 1e6:.2f} M, after "
              f"{v['after'] / 1e6:.2f} M, causal minimum {v['needed'] / 1e6:.2f} M")
    engines = {}
    for c in chunks:
        for variant in ("before", "after"):
            t = time.perf_counter()
            with unskipped() if variant == "before" else contextlib.nullcontext():
                eng = build(c, a)
                state = None
                for w, ls in work.items():
                    state, _ = prefill(eng, ls, 0, state)
            engines[(c, variant)] = [eng, state]
            print(f"warm-up chunk {c} {variant}: {time.perf_counter() - t:.1f} s", flush=True)
    res: dict = {}
    for r in range(a.rounds):
        for c in chunks:
            for w, ls in work.items():
                for variant in ("before", "after"):
                    eng, state = engines[(c, variant)]
                    with unskipped() if variant == "before" else contextlib.nullcontext():
                        state, s = prefill(eng, ls, 1 + r, state)
                    engines[(c, variant)][1] = state
                    res.setdefault(f"{w}/chunk{c}/{variant}", []).append(s)
                    print(f"round {r} {w:6s} chunk {c:5d} {variant:6s} prefill {s:7.3f} s; "
                          f"load {os.getloadavg()[0]:.2f}", flush=True)
    print("\nmedian [min-max] over rounds; before / after per round:")
    summary = {}
    for c in chunks:
        for w in work:
            b, f = res[f"{w}/chunk{c}/before"], res[f"{w}/chunk{c}/after"]
            ratio = [x / y for x, y in zip(b, f)]
            summary[f"{w}/chunk{c}"] = {"before_s": b, "after_s": f, "speedup": ratio, **counts[f"{w}/chunk{c}"]}
            print(f"  {w:6s} chunk {c:5d}: before {statistics.median(b):.3f} [{min(b):.3f}-{max(b):.3f}] s, after "
                  f"{statistics.median(f):.3f} [{min(f):.3f}-{max(f):.3f}] s, speed-up "
                  f"{', '.join(f'{x:.2f}' for x in ratio)} (median {statistics.median(ratio):.2f})")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    finish(a, load0, os.getloadavg(), summary, git_commit=commit.stdout.strip() or None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
