"""Multi-turn prefill work and episodes/s: K/V kept across turns vs re-prefilling every turn.

    .venv/bin/python bench/agentic_prefill.py [--env retail] [--episodes 16] [--turns 6] [--size tiny]
        [--rounds 3] [--json docs/results/agentic_prefill_<date>.json]

The episodes are the env's own (``--env``, default ``retail``): its rendered system prompt (policy +
tool schemas, the ``model.tokenizer=bpe`` tokenizer ``jax-rl train`` builds for that env), its tasks
(seeds 0..``--episodes``-1) and its tool outputs: the tool calls of the env's reference solution, played
through ``env.step``, cycled until the episode has ``--turns`` assistant turns (the reference paths
have 3-4; tau-bench-style episodes run 5-30). The model is a random-weight Qwen3 (``--size``: ``tiny``
= the tiny_dense preset, ``small`` = d=256, 4 layers) in fp32, so both arms produce the same tokens
(checked): each assistant turn generates exactly as many tokens as the reference turn it stands for
(no stop id), then the turn's real tool observation (``ChatTokenizer.tool_turn_ids``) is appended,
exactly the context layout of :class:`rollout.agent.AgentLoop`. All episodes run turn by turn in
lock-step through one :class:`rollout.generator.Generator` (``--episodes`` slots, the default
``decode_steps`` 4 and prefill budget), each episode its own session, with the shared prefix length
(the rendered system message) passed as the agent passes it.

Arms, interleaved per round: ``keep_kv`` (``rollout.keep_kv=true``, prefix cache 4: the defaults),
``reprefill`` (``rollout.keep_kv=false``: every turn re-prefills the conversation; prefix cache on) and
``reprefill_nocache`` (both off: the engine before issue 36's K/V work). Per arm: ``prefill_tokens /
episode_tokens`` (the metric ``jax-rl train`` logs per step; target <= 1.1), episodes/s, and the
per-stage walls (engine prefill calls, decode calls, and the rest: host work), each engine call timed
to completion (``jax.block_until_ready``). Compiles are excluded (one warm-up round per arm). Medians
with [min-max] over ``--rounds``; figures appended to ``--json`` with the load average.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_HERE = os.path.dirname(os.path.abspath(__file__))
from _record import ROOT  # noqa: E402,F401  (the bench preamble: the repository first on sys.path)

from _record import SMALL_DIMS, finish, median_range  # noqa: E402

SIZES = {
    "tiny": {},
    "small": SMALL_DIMS,
}
ARMS = {"keep_kv": dict(keep_kv=True, prefix_cache=4), "reprefill": dict(keep_kv=False, prefix_cache=4),
        "reprefill_nocache": dict(keep_kv=False, prefix_cache=0)}


class TimedEngine:
    """The engine with its prefill and decode calls timed to completion (``stats``: seconds)."""

    PREFILL = ("prefill_slots", "prefill_tokens", "insert", "copy_slot")
    DECODE = ("decode", "decode_steps", "free_slots")

    def __init__(self, engine):
        self._e = engine
        self.stats = {"prefill_s": 0.0, "decode_s": 0.0}

    def __getattr__(self, name):
        fn = getattr(self._e, name)
        kind = "prefill_s" if name in self.PREFILL else "decode_s" if name in self.DECODE else None
        if kind is None or not callable(fn):
            return fn
        import jax

        def timed(*a, **kw):
            t = time.perf_counter()
            out = jax.block_until_ready(fn(*a, **kw))
            self.stats[kind] += time.perf_counter() - t
            return out

        return timed


def episodes_spec(env_name: str, n: int, turns: int):
    """(tokenizer, [(prompt ids, shared prefix length, [(turn tokens to generate, observation ids)])])."""
    from jax_rl.config import load_config
    from jax_rl.runtime.envs import build_env_factory, build_tokenizer
    from rollout.agent import shared_prefix_len

    cfg = load_config(os.path.join(os.path.dirname(_HERE), "configs", "tiny_cpu.yaml"), [f"env.name={env_name}"])
    factory = build_env_factory(cfg)
    tok = build_tokenizer(cfg, factory)
    out = []
    for seed in range(n):
        env = factory()
        msgs, tools = env.reset(seed)
        prompt, _ = tok.render_chat(msgs, tools, add_generation_prompt=True)
        ref = env.reference_solution(seed)
        tool_turns = []  # (assistant tool-call text, [observations])
        for i, m in enumerate(ref):
            if m["role"] == "assistant" and m.get("tool_calls"):
                text = "".join("<tool_call>\n" + json.dumps(c) + "\n</tool_call>" for c in m["tool_calls"])
                obs = []
                for nxt in ref[i + 1:]:
                    if nxt["role"] != "tool":
                        break
                    obs.append(nxt["content"])
                tool_turns.append((text, obs))
        answer = next(m["content"] for m in reversed(ref) if m["role"] == "assistant")
        plan = [(len(tok.encode(t)) + 1, tok.tool_turn_ids(o, add_generation_prompt=True))
                for t, o in (tool_turns[k % len(tool_turns)] for k in range(turns - 1))]
        plan.append((len(tok.encode(answer)) + 1, None))
        out.append((prompt, shared_prefix_len(tok, msgs, tools, prompt), plan))
    return tok, out


def run_arm(engine, episodes, *, keep_kv: bool, prefix_cache: int, seed: int) -> dict:
    """All episodes, turn by turn in lock-step; returns the arm's figures and the generated tokens."""
    from rollout.generator import Generator

    timed = TimedEngine(engine)
    gen = Generator(timed, decode_steps=4, keep_kv=keep_kv, prefix_cache=prefix_cache)
    ctx = [list(p) for p, _, _ in episodes]
    gen_tokens: list = [[] for _ in episodes]
    prefill = 0
    t0 = time.perf_counter()
    for k in range(max(len(plan) for _, _, plan in episodes)):
        futs = {}
        for e, (_, plen, plan) in enumerate(episodes):
            if k < len(plan):
                futs[e] = gen.submit(ctx[e], max_new_tokens=plan[k][0], seed=seed * 1000 + e * 31 + k, stop_ids=(),
                                     session=("ep", e), prefix_len=plen)
        gen.run_until_idle()
        for e, f in futs.items():
            c = f.result(timeout=0)
            prefill += int(c.info["prefill_tokens"])
            gen_tokens[e].append(list(c.tokens))
            obs = episodes[e][2][k][1]
            ctx[e] += list(c.tokens) + (list(obs) if obs is not None else [])
            if obs is None:
                gen.release_session(("ep", e))
    wall = time.perf_counter() - t0
    ep_tokens = sum(len(c) for c in ctx)
    host = wall - timed.stats["prefill_s"] - timed.stats["decode_s"]
    return {"ratio": prefill / ep_tokens, "prefill_tokens": prefill, "episode_tokens": ep_tokens,
            "episodes_s": len(episodes) / wall, "wall_s": wall, "prefill_s": timed.stats["prefill_s"],
            "decode_s": timed.stats["decode_s"], "host_s": host, "kv_reused": int(gen.stats["kv_reused_tokens"]),
            "kv_evictions": int(gen.stats["kv_evictions"]), "prefix_hits": int(gen.stats["prefix_hits"]),
            "_tokens": gen_tokens}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--env", default="retail")
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6, help="assistant turns per episode (the last one answers)")
    ap.add_argument("--size", default="tiny", choices=sorted(SIZES))
    ap.add_argument("--cache", type=int, default=4096, help="rollout.max_cache_len")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--json", default=os.path.join(os.path.dirname(_HERE), "docs", "results",
                                                   f"agentic_prefill_{dt.date.today():%Y%m%d}.json"))
    a = ap.parse_args(argv)
    load0 = os.getloadavg()
    print(f"load average before: {load0[0]:.1f} {load0[1]:.1f} {load0[2]:.1f}", flush=True)
    from flax import nnx

    from jax_rl.models import qwen3 as q
    from rollout.engine import Qwen3Engine

    tok, episodes = episodes_spec(a.env, a.episodes, a.turns)
    lens = [len(p) for p, _, _ in episodes]
    print(f"{a.env}: {a.episodes} episodes x {a.turns} turns; prompts {min(lens)}-{max(lens)} tokens, shared prefix "
          f"{episodes[0][1]} tokens (vocab {tok.vocab_size})", flush=True)
    cfg = q.get_preset("tiny_dense", vocab_size=max(384, tok.vocab_size), **SIZES[a.size])
    params = nnx.state(q.Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    eng = Qwen3Engine(cfg, params, slots=a.episodes, max_cache_len=a.cache, max_prefill_length=256,
                      dtype="float32", temperature=1.0, kv_layout="contiguous")
    for name in a.arms:  # warm-up: the programs of every bucket this run meets
        t = time.perf_counter()
        run_arm(eng, episodes, seed=0, **ARMS[name])
        print(f"warm-up {name}: {time.perf_counter() - t:.1f} s", flush=True)
    res: dict = {name: [] for name in a.arms}
    same = True
    for r in range(a.rounds):
        toks = {}
        for name in a.arms:
            m = run_arm(eng, episodes, seed=r + 1, **ARMS[name])
            toks[name] = m.pop("_tokens")
            res[name].append(m)
            print(f"round {r} {name}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                     for k, v in m.items()), flush=True)
        ref = toks[a.arms[0]]
        same = same and all(toks[n] == ref for n in a.arms)
    load1 = os.getloadavg()

    def med(name, key):
        return median_range([m[key] for m in res[name]])

    print(f"\n{a.env}, {a.size}, fp32: {a.episodes} episodes x {a.turns} turns, {a.rounds} rounds; same tokens in "
          f"every arm: {same}")
    print("| arm | prefill_tokens / episode_tokens | episodes/s | x reprefill | prefill s | decode s | host s |")
    print("|---|---|---|---|---|---|---|")
    base = med("reprefill", "episodes_s")[0] if "reprefill" in res else None
    for name in a.arms:
        c = [f"{med(name, 'ratio')[0]:.3f}"]
        m, lo, hi = med(name, "episodes_s")
        c.append(f"{m:.2f} [{lo:.2f}-{hi:.2f}]")
        c.append(f"{m / base:.2f}x" if base else "-")
        for key in ("prefill_s", "decode_s", "host_s"):
            m, lo, hi = med(name, key)
            c.append(f"{m:.2f} [{lo:.2f}-{hi:.2f}]")
        print(f"| {name} | " + " | ".join(c) + " |")
    finish(a, load0, load1, res, same_tokens=same)
    return 0


if __name__ == "__main__":
    sys.exit(main())
