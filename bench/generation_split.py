"""Where a generator call's time goes: engine prefill, engine decode and host, per call.

    .venv/bin/python bench/generation_split.py [--hf DIR] [--prompt-len 43] [--new-tokens 1 8]
        [--slots 64] [--groups 8] [--decode-steps 4] [--rounds 6] [--json docs/results/generation_split_<date>.json]

The shape of ``bench/e2e_rl.py``'s generation probe (its ``jaxrl_grouped`` call): one
``Generator.generate`` of ``--slots`` prompts of ``--prompt-len`` random ids, ``--groups`` distinct
prompts each repeated (a GRPO batch: 64 = 8 groups of 8), ``--new-tokens`` tokens each (no stop id),
fp32, on ``Qwen3Engine(slots)`` with ``rollout.decode_steps`` = ``--decode-steps``; the model is the
checkpoint ``--hf`` (e.g. the bench's ``base/hf``) or, without it, the tiny_dense preset at random
weights (the timing does not depend on the weights: no stop id). Every engine call is timed to
completion (``bench/agentic_prefill.py``'s ``TimedEngine``); host = the call's wall minus both.

Arms, interleaved per round (compiles excluded: one warm-up call per arm and token count):
``bounded`` (the generator's own decode-step choice: no more steps per call than the live slots can
use, ``Generator.step_counts``) and ``fixed`` (every decode call a whole ``--decode-steps`` scan,
whatever the slots still need: the generator before that choice). Both produce the same tokens
(checked). Printed per arm and token count: median [min-max] ms per call of the wall, engine prefill,
engine decode and host, with the decode calls and steps per call; appended to ``--json`` with the load
average.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_HERE = os.path.dirname(os.path.abspath(__file__))
from _record import ROOT  # noqa: E402,F401  (the bench preamble: the repository first on sys.path)

from _record import finish, median_range  # noqa: E402
from agentic_prefill import TimedEngine  # noqa: E402

ARMS = ("bounded", "fixed")


def build(a):
    """(model config, params) from ``--hf`` or the tiny_dense preset."""
    from flax import nnx

    from jax_rl.models import hf_io
    from jax_rl.models import qwen3 as q

    if a.hf:
        model, _ = hf_io.load_pretrained(a.hf)
    else:
        model = q.Qwen3ForCausalLM(q.get_preset("tiny_dense"), rngs=nnx.Rngs(0))
    return model.config, nnx.state(model, nnx.Param)


def runner(cfg, params, a, new_tokens: int, arm: str):
    """A callable: one generate call -> its figures (wall, prefill, decode, host seconds; calls, steps)."""
    from rollout_decode import grouped_prompts

    from rollout.engine import Qwen3Engine
    from rollout.generator import Generator

    eng = Qwen3Engine(cfg, params, slots=a.slots, max_cache_len=a.prompt_len + new_tokens + 1,
                      max_prefill_length=a.prompt_len, dtype="float32", temperature=1.0, kv_layout="contiguous")
    timed = TimedEngine(eng)
    gen = Generator(timed, decode_steps=a.decode_steps)
    if arm == "fixed":  # every call a whole decode_steps scan
        gen.loop.call_steps = lambda: gen.decode_steps
    prompts = grouped_prompts(a.slots, a.prompt_len, cfg.vocab_size, a.groups)
    seed = [0]

    def run() -> dict:
        seed[0] += 1
        before = dict(timed.stats)
        calls0, steps0 = gen.stats["calls"], gen.stats["steps"]
        t = time.perf_counter()
        outs = gen.generate(prompts, max_new_tokens=new_tokens, seeds=[seed[0] * 1000 + i for i in range(a.slots)])
        wall = time.perf_counter() - t
        pre = timed.stats["prefill_s"] - before["prefill_s"]
        dec = timed.stats["decode_s"] - before["decode_s"]
        return {"wall_s": wall, "prefill_s": pre, "decode_s": dec, "host_s": wall - pre - dec,
                "decode_calls": gen.stats["calls"] - calls0, "decode_steps": gen.stats["steps"] - steps0,
                "_tokens": [tuple(o.tokens) for o in outs]}

    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hf", default="", help="an HF checkpoint folder (default: tiny_dense, random weights)")
    ap.add_argument("--prompt-len", type=int, default=43)
    ap.add_argument("--new-tokens", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--decode-steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--json", default=os.path.join(os.path.dirname(_HERE), "docs", "results",
                                                   f"generation_split_{dt.date.today():%Y%m%d}.json"))
    a = ap.parse_args(argv)
    cfg, params = build(a)
    load0 = os.getloadavg()
    print(f"{a.slots} prompts of {a.prompt_len} tokens ({a.groups} groups), decode_steps {a.decode_steps}, "
          f"{a.rounds} rounds; load average {load0[0]:.1f} {load0[1]:.1f} {load0[2]:.1f}", flush=True)
    runs = {(n, arm): runner(cfg, params, a, n, arm) for n in a.new_tokens for arm in a.arms}
    for r in runs.values():  # compiles
        r()
    got: dict = {key: [] for key in runs}
    for _ in range(a.rounds):
        for key, r in runs.items():
            got[key].append(r())
    results: dict = {}
    for n in a.new_tokens:
        toks = {arm: [x.pop("_tokens") for x in got[(n, arm)]] for arm in a.arms}
        same = all(t == toks[a.arms[0]] for t in toks.values())
        for arm in a.arms:
            xs = got[(n, arm)]
            row = {k: median_range([x[k] for x in xs]) for k in ("wall_s", "prefill_s", "decode_s", "host_s")}
            row.update(decode_calls=xs[0]["decode_calls"], decode_steps=xs[0]["decode_steps"], same_tokens=same)
            results[f"{arm}_{n}"] = row
            ms = lambda k: f"{row[k][0] * 1e3:6.1f} [{row[k][1] * 1e3:.1f}-{row[k][2] * 1e3:.1f}]"  # noqa: E731
            print(f"{n:3d} tokens {arm:8s} wall {ms('wall_s')} prefill {ms('prefill_s')} decode {ms('decode_s')} "
                  f"host {ms('host_s')} ms per call; {row['decode_calls']} decode calls, {row['decode_steps']} "
                  f"steps; same tokens as the other arm: {same}", flush=True)
    finish(a, load0, os.getloadavg(), results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
