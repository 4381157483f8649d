"""Decode under a burst: tokens/s of the slots that are decoding while a burst of new requests arrives.

    .venv/bin/python bench/decode_burst.py [--size tiny|small] [--slots 32] [--running 8] [--burst 24]
        [--prompt 192] [--decode-steps 4] [--rounds 3] [--json docs/results/decode_burst_<date>.json]

One process, one engine (``Qwen3Engine``, bf16, the ``--size`` model: ``tiny`` = the tiny_dense preset,
``small`` = bench/learner_step.py's small: d=256, 4 layers, 8/4 heads, V=1024), one
``rollout.generator.Generator`` stepped in this thread. Per measurement:

1. ``--running`` requests (16-token prompts, no stop, a budget that outlasts the measurement) are
   admitted and decoded for a few steps (the *running* slots);
2. steady state: ``--steady`` generator steps; the running slots' tokens / wall second is the
   baseline;
3. the burst: ``--burst`` new requests of ``--prompt`` random tokens each (distinct prompts, 8 new
   tokens each) are queued at once, and the generator steps until every burst request has been
   admitted (prefilled into a slot), and for at least ``--steady`` steps. Over that window the bench
   records the running slots' tokens / wall second, the longest single generator step (the longest
   time a running slot waited for its next tokens), and the steps and seconds until the whole burst
   was admitted (its requests' wait for their first token).

Arms, interleaved per round (A B A B ...): ``budget`` = the generator's default prefill budget
(``rollout.prefill_tokens_per_step`` null: 4 x ``max_prefill_length`` tokens per step while a slot
decodes) and ``unbounded`` (a budget of 10^9 tokens: the whole burst is prefilled in the first step).
Compiles are excluded (one warm-up measurement per arm first). Prints a table of medians with
[min-max] over ``--rounds`` and appends the figures to ``--json`` with the host's load average
before and after. A CPU figure on a shared host: ratios between the two arms of one run, not
absolute speed, are the result.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_HERE = os.path.dirname(os.path.abspath(__file__))
from _record import ROOT  # noqa: E402,F401  (the bench preamble: the repository first on sys.path)

from _record import SMALL_DIMS, finish, median_range  # noqa: E402

SIZES = {
    "tiny": {},
    "small": {"vocab_size": 1024, **SMALL_DIMS},
}
UNBOUNDED = 10**9


def build(size: str, slots: int, cache: int, prefill_len: int):
    """(engine, vocab) for the ``size`` model with random weights (bf16 rollout dtype)."""
    from flax import nnx

    from jax_rl.models import qwen3 as q
    from rollout.engine import Qwen3Engine

    cfg = q.get_preset("tiny_dense", **SIZES[size])
    params = nnx.state(q.Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    eng = Qwen3Engine(cfg, params, slots=slots, max_cache_len=cache, max_prefill_length=prefill_len,
                      dtype="bfloat16", temperature=1.0, kv_layout="contiguous")
    return eng, cfg.vocab_size


def measure(eng, vocab: int, *, budget: int, running: int, burst: int, prompt: int, steady: int,
            decode_steps: int, seed: int) -> dict:
    """One measurement (module docstring): the running slots' tokens/s in steady state and during the
    burst's admission, the longest step in that window and the steps the admissions took."""
    import numpy as np

    from rollout.generator import Generator

    rng = np.random.default_rng(seed)
    gen = Generator(eng, decode_steps=decode_steps, prefill_budget=budget, prefix_cache=0)
    budget_new = eng.max_cache_len - 17
    run = [gen.submit(list(map(int, rng.integers(1, vocab, 16))), max_new_tokens=budget_new, seed=i)
           for i in range(running)]
    ids = [f.request_id for f in run]

    def running_tokens() -> int:
        return sum(len((gen.partial_tokens(i) or ([],))[0]) for i in ids)

    for _ in range(3):  # admitted and decoding
        gen.step()
    n0, t0 = running_tokens(), time.perf_counter()
    for _ in range(steady):
        gen.step()
    steady_s = time.perf_counter() - t0
    steady_tok = running_tokens() - n0
    futs = [gen.submit(list(map(int, rng.integers(1, vocab, prompt))), max_new_tokens=8, seed=1000 + i)
            for i in range(burst)]
    n1, t1 = running_tokens(), time.perf_counter()
    steps, longest, admit_s, admit_steps = 0, 0.0, None, None
    while gen.num_queued or steps < steady:
        ts = time.perf_counter()
        gen.step()
        longest = max(longest, time.perf_counter() - ts)
        steps += 1
        if admit_s is None and not gen.num_queued:
            admit_s, admit_steps = time.perf_counter() - t1, steps
    burst_s = time.perf_counter() - t1
    burst_tok = running_tokens() - n1
    while not all(f.done() for f in futs):  # the burst's own tokens (not timed)
        gen.step()
    for f in run:
        f.cancel()
    return {"steady_tok_s": steady_tok / steady_s, "burst_tok_s": burst_tok / burst_s,
            "ratio": (burst_tok / burst_s) / (steady_tok / steady_s), "longest_step_s": longest,
            "steady_step_s": steady_s / steady, "admit_steps": admit_steps, "admit_s": admit_s,
            "window_steps": steps, "window_s": burst_s,
            "prefill_tokens": int(gen.stats["prefill_tokens"]), "prefill_calls": int(gen.stats["prefill_calls"])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="tiny", choices=sorted(SIZES))
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--running", type=int, default=8)
    ap.add_argument("--burst", type=int, default=24)
    ap.add_argument("--prompt", type=int, default=192, help="burst prompt length (tokens)")
    ap.add_argument("--max-prefill-length", type=int, default=256)
    ap.add_argument("--cache", type=int, default=512)
    ap.add_argument("--decode-steps", type=int, default=4)
    ap.add_argument("--steady", type=int, default=8, help="steady-state generator steps timed")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=os.path.join(os.path.dirname(_HERE), "docs", "results",
                                                   f"decode_burst_{dt.date.today():%Y%m%d}.json"))
    a = ap.parse_args(argv)
    if a.running + a.burst > a.slots:
        ap.error(f"--running + --burst ({a.running + a.burst}) must fit in --slots ({a.slots})")
    load0 = os.getloadavg()
    print(f"load average before: {load0[0]:.1f} {load0[1]:.1f} {load0[2]:.1f}", flush=True)
    eng, vocab = build(a.size, a.slots, a.cache, a.max_prefill_length)
    default_budget = 4 * eng.max_prefill_length
    arms = {"budget": default_budget, "unbounded": UNBOUNDED}
    kw = dict(running=a.running, burst=a.burst, prompt=a.prompt, steady=a.steady, decode_steps=a.decode_steps)
    for name, b in arms.items():  # warm-up: every program this run meets is compiled here
        t = time.perf_counter()
        measure(eng, vocab, budget=b, seed=0, **kw)
        print(f"warm-up {name}: {time.perf_counter() - t:.1f} s", flush=True)
    res = {name: [] for name in arms}
    for r in range(a.rounds):
        for name, b in arms.items():
            m = measure(eng, vocab, budget=b, seed=r + 1, **kw)
            res[name].append(m)
            print(f"round {r} {name}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                     for k, v in m.items()), flush=True)
    load1 = os.getloadavg()

    def med(name, key):
        return median_range([m[key] for m in res[name]])

    print(f"\n{a.size}: {a.running} running slots, a burst of {a.burst} x {a.prompt}-token prompts, "
          f"{a.slots} slots, decode_steps {a.decode_steps}, budget {default_budget} tokens/step")
    print("| arm | running tok/s steady | running tok/s during the burst | burst / steady | longest step s | "
          "steady step s | steps to admit the burst | s to admit the burst |")
    print("|---|---|---|---|---|---|---|---|")
    for name in arms:
        cells = []
        for key, fmt in (("steady_tok_s", "{:,.0f}"), ("burst_tok_s", "{:,.0f}"), ("ratio", "{:.2f}"),
                         ("longest_step_s", "{:.3f}"), ("steady_step_s", "{:.3f}"), ("admit_steps", "{:.0f}"),
                         ("admit_s", "{:.3f}")):
            m, lo, hi = med(name, key)
            cells.append(f"{fmt.format(m)} [{fmt.format(lo)}-{fmt.format(hi)}]")
        print(f"| {name} | " + " | ".join(cells) + " |")
    finish(a, load0, load1, res, budget_tokens=default_budget)
    return 0


if __name__ == "__main__":
    sys.exit(main())
