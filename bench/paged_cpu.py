"""The paged engine's decode on the CPU against the contiguous layout's, broken down (issue 46).

Usage::

    taskset -c 0 nice -n 10 .venv/bin/python bench/paged_cpu.py [--slots 8] [--prompt 5456] [--tail 260]
        [--groups 2] [--cache 12288] [--calls 24] [--decode-steps 4] [--rounds 3] [--layouts contiguous,paged]

``--layouts`` entries ``paged:N`` build the paged engine with ``rollout.prefill_chunk_size`` N (``paged``: the
default, 2,048).

The tau2 retail shape on the tiny tau2 model (``configs/tau2_retail.yaml``: tiny_dense with 2 q heads, 1 kv
head of 64, vocab 1,024; ``rollout.slots`` 8, ``max_cache_len`` 12,288, bf16, ``decode_steps`` 4): ``--groups``
GRPO groups of ``slots / groups`` samples each, every context the same ``--prompt``-token system prompt plus a
``--tail``-token task of its group (random ids, fixed seed). Per layout one engine is built and warmed (one
prefill, ``--calls`` decode calls: every program the measurement runs is compiled then); then ``--rounds``
rounds run each layout in turn (interleaved: this host's load swings): the slots freed and prefilled
again with a new system prompt (no prefix hit; ``prefill_s``, the whole ``prefill_slots`` call: the
contiguous engine runs all ``slots`` rows, the paged one each group's prompt once) and ``--calls`` calls of ``decode_steps(--decode-steps)`` timed, each split into

- ``host_ms``: the engine's host work before the program is dispatched (paged: the pages each active slot
  needs for the call, copy-on-write, the page table pushed; ``PagedLayout.before_decode``),
- ``dispatch_ms``: the jitted call returning (argument handling, launch; XLA:CPU may run part of the
  program inline here),
- ``device_ms``: from then until the outputs are ready (``block_until_ready``),

and the compiles seen during the timed calls (``jax.monitoring``'s backend-compile events; 0 expected: a
compile there is a program the warm-up did not reach). Prints per round and the median [min-max] of the
per-call totals, tokens/s (slots x steps per call / call time), and paged / contiguous.
"""

from __future__ import annotations

import argparse
import statistics
import time

from _record import ROOT  # noqa: F401  (the bench preamble: the repository first on sys.path)

_COMPILES = [0]


def _on_event(name: str, *_a, **_k) -> None:
    if name == "/jax/core/compile/backend_compile_duration":
        _COMPILES[0] += 1


def build(layout: str, a) -> tuple:
    """(engine, params, decode state) for ``layout`` at the tau2 retail shape."""
    from flax import nnx

    from jax_rl.models import qwen3 as q
    from rollout.engine import Qwen3Engine

    cfg = q.get_preset("tiny_dense", num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                       rope_theta=10000.0, vocab_size=1024)
    params = nnx.state(q.Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    kind, _, chunk = layout.partition(":")  # paged:1024 = rollout.prefill_chunk_size 1024
    eng = Qwen3Engine(cfg, params, slots=a.slots, max_cache_len=a.cache, max_prefill_length=a.cache,
                      dtype="bfloat16", temperature=1.0, kv_layout=kind,
                      **({"prefill_chunk_size": int(chunk)} if chunk else {}))
    return eng, eng.params


def contexts(a, seed: int = 0) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    system = list(map(int, rng.integers(1, 1024, a.prompt)))
    per = a.slots // a.groups
    tails = [list(map(int, rng.integers(1, 1024, a.tail))) for _ in range(a.groups)]
    return [system + tails[i // per] for i in range(a.slots)]


def fill(eng, params, ctxs, state=None):
    """``state`` (None: a fresh one) with every slot freed and prefilled again (a group's rows share a
    prefill on pages)."""
    import jax

    from rollout.engine.slots import SlotPrefill

    if state is None:
        state = eng.init_decode_state()
    else:
        state = eng.free_slots(state, range(eng._slots))
    rows = [SlotPrefill(tokens=c, slot=i, seed=i) for i, c in enumerate(ctxs)]
    state, _ = eng.prefill_slots(params, state, rows)
    jax.block_until_ready(state)
    return state


def timed_calls(eng, params, state, calls: int, n: int) -> tuple[dict, list]:
    """``calls`` decode calls of ``n`` steps, each split into host / dispatch / device ms."""
    import jax

    rows = []
    for _ in range(calls):
        t0 = time.perf_counter()
        state, step_kw = eng.kv.before_decode(state, n)  # the layout's host side (paged: pages, the table)
        t1 = time.perf_counter()
        state, out = eng.programs["decode_steps"](params, state, n, jax.numpy.int32(0), **step_kw)
        state = eng.kv.after_call(state)  # as decode_steps does (paged: the next call sends no unchanged table)
        t2 = time.perf_counter()
        jax.block_until_ready((state, out))
        t3 = time.perf_counter()
        rows.append(((t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3))
    return state, rows


def summarize(rows: list) -> dict:
    host, disp, dev = (sum(r[i] for r in rows) / len(rows) for i in range(3))
    return {"host_ms": host, "dispatch_ms": disp, "device_ms": dev, "call_ms": host + disp + dev}


def main(argv=None) -> int:
    import os

    import jax

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=5456)
    ap.add_argument("--tail", type=int, default=260)
    ap.add_argument("--cache", type=int, default=12288)
    ap.add_argument("--calls", type=int, default=24)
    ap.add_argument("--decode-steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layouts", default="contiguous,paged")
    a = ap.parse_args(argv)
    jax.monitoring.register_event_duration_secs_listener(_on_event)
    print(f"jax {jax.__version__} {jax.default_backend()}; load {os.getloadavg()}; slots {a.slots} "
          f"({a.groups} groups), context {a.prompt}+{a.tail}, cache {a.cache}, {a.calls} calls x "
          f"{a.decode_steps} steps", flush=True)
    ctxs = contexts(a)
    layouts = a.layouts.split(",")
    built = {}
    for lay in layouts:
        t = time.perf_counter()
        c0 = _COMPILES[0]
        eng, params = build(lay, a)
        state = fill(eng, params, ctxs)
        state, _ = timed_calls(eng, params, state, a.calls, a.decode_steps)
        built[lay] = [eng, params, state]
        print(f"warm-up {lay}: {time.perf_counter() - t:.1f} s, {_COMPILES[0] - c0} compiles", flush=True)
    res = {lay: [] for lay in layouts}
    for r in range(a.rounds):
        for lay in layouts:
            eng, params, state = built[lay]
            t = time.perf_counter()
            state = fill(eng, params, contexts(a, 1 + r), state)  # a new system prompt: no prefix hit
            fill_s = time.perf_counter() - t
            c0 = _COMPILES[0]
            state, rows = timed_calls(eng, params, state, a.calls, a.decode_steps)
            built[lay][2] = state
            s = summarize(rows)
            s["compiles"] = _COMPILES[0] - c0
            s["prefill_s"] = fill_s
            s["tok_s"] = a.slots * a.decode_steps / (s["call_ms"] / 1e3)
            res[lay].append(s)
            print(f"round {r} {lay:10s} call {s['call_ms']:7.2f} ms = host {s['host_ms']:6.2f} + dispatch "
                  f"{s['dispatch_ms']:6.2f} + device {s['device_ms']:7.2f}; {s['tok_s']:7.1f} tok/s; "
                  f"compiles {s['compiles']}; prefill {fill_s:.2f} s; load {os.getloadavg()[0]:.2f}", flush=True)
    print("\nmedian [min-max] over rounds, per call of", a.decode_steps, "steps:")
    for lay in layouts:
        line = []
        for k in ("call_ms", "host_ms", "dispatch_ms", "device_ms", "tok_s", "prefill_s"):
            v = [x[k] for x in res[lay]]
            line.append(f"{k} {statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}]")
        print(f"  {lay:10s} " + "; ".join(line))
    for lay in (x for x in layouts if x.startswith("paged") and res.get("contiguous")):
        for k, what in (("call_ms", "tok/s"), ("prefill_s", "prefill speed")):
            ratios = [c[k] / p[k] for c, p in zip(res["contiguous"], res[lay])]
            print(f"  {lay} {what} / contiguous {what}, per round: {', '.join(f'{x:.2f}' for x in ratios)} "
                  f"(median {statistics.median(ratios):.2f})")
    print(f"load {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
