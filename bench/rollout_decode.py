"""Decode throughput: jax-rl's engine + generator vs transformers ``generate`` vs Tunix's ``Sampler``.

Usage::

    .venv/bin/python bench/rollout_decode.py [--platform cpu|gpu|tpu] [--preset tiny_dense|small|<jax_rl preset>]
        [--prompt-len 16] [--new-tokens 128] [--slots 1,8,32] [--dtypes bfloat16,float32]
        [--rounds 5] [--scan-layers true|false] [--decode-steps 1,8] [--no-hf] [--no-tunix]
        [--matmul-bound]

    # with the Tunix row (the bench venv; see bench/_tunix.py and the README):
    /work/bench-venv/bin/python bench/rollout_decode.py --preset small --slots 32 --new-tokens 128

Every side runs the same architecture (``--preset``; ``small`` = the issue's reference setting:
V=1024, d=256, 4 layers, 8/4 heads of 32, ff=768, fp32 on the Tunix comparison) with the SAME
weights: the transformers model is built first and saved as one HF checkpoint folder, which our
``hf_io.load_pretrained`` and Tunix's ``qwen3.params.create_model_from_safe_tensors`` each read
(the printed ``max |dlogits|`` checks it). A measurement generates ``--new-tokens`` tokens for
each of ``slots`` prompts of ``--prompt-len`` random ids (no early stop) and reports generated
tokens / wall second, prefill included on every side:

- jax-rl: ``Generator(Qwen3Engine(slots))``, continuous batching over the slots (each prompt
  prefilled alone and inserted), temperature 1, per-token log-probs and version tags
  returned, one jitted call and one host transfer per ``--decode-steps`` tokens
  (``rollout.decode_steps``; weight swaps happen between calls); a comma list gives one row per
  value. ``--dtypes``: the rollout dtype(s); ``rollout.dtype`` defaults to bfloat16. On the CPU the engine decodes with
  unrolled layers and a per-layer KV cache whatever ``--scan-layers`` says (``kv_per_layer``;
  ``--scan-layers`` then only sets the param layout it is handed).
- transformers: ``generate`` in torch fp32, ``use_cache=True``, batch = slots, greedy (cheaper
  than sampling; no log-probs), with the faster of 1 and all-cores torch threads.
- Tunix (google-tunix 0.1.7, only when it imports; else the row says ``skipped: google-tunix
  not installed``): ``tunix.generate.sampler.Sampler`` on Tunix's Qwen3 in fp32 (``--tunix-dtype``),
  one batched prefill + an on-device ``while_loop``, temperature 1 (top_p=1), log-probs ON.
  No continuous batching, no weight swap inside a batch, no version tags.

- ``--matmul-bound``: per ``--dtypes``, the decode step cut down to its weight matmuls (no
  attention, sampling, cache or host work; ``matmul_bound_runner``), the same number of steps at
  the same slots, the last ``--decode-steps`` value per call: the most tokens/s any decode of this
  model in that dtype can make on this machine. If it is below a target, the target cannot be met
  in that dtype here.

Every runner is warmed up once (compilation excluded), then ``--rounds`` rounds run every
runner once each, interleaved (A B C A B C ...), all in this one process; the table gives the
median and [min-max] over the rounds and the ratio of medians. The machine's load is printed
before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
from _record import ROOT  # noqa: E402,F401  (the bench preamble: the repository first on sys.path)

from _record import SMALL_DIMS, add_platform_arg, decode_roofline, environment, select_platform  # noqa: E402

select_platform()  # --platform cpu|gpu|tpu, before jax is imported (default cpu)

import numpy as np  # noqa: E402

import _tunix  # noqa: E402

SMALL = {"vocab_size": 1024, **SMALL_DIMS}
"""The issue's reference Qwen3 (= ``bench/learner_step.py``'s ``small``)."""


def _config(preset: str):
    from jax_rl.models import qwen3 as q

    if preset == "small":
        return q.get_preset("tiny_dense", **SMALL)
    return q.get_preset(preset)


def _hf_model(cfg):
    import torch
    import transformers

    hf_cfg = transformers.Qwen3Config(**{k: v for k, v in cfg.to_hf().items()
                                         if k not in ("architectures", "model_type", "dtype", "torch_dtype")})
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(hf_cfg).eval().float()


def _checkpoint(cfg, tmpdir: str, use_hf: bool):
    """One HF checkpoint folder for every side: transformers' model when torch is used, else our
    random init written by ``hf_io.save_pretrained``. Returns the torch model or None."""
    from jax_rl.models import hf_io

    if use_hf:
        hf = _hf_model(cfg)
        hf.save_pretrained(tmpdir)
        return hf
    from flax import nnx

    from jax_rl.models import qwen3 as q

    hf_io.save_pretrained(q.Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0)), cfg, tmpdir)
    return None


def _prompts(n: int, prompt_len: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(1, vocab, prompt_len)] for _ in range(n)]


def grouped_prompts(slots: int, prompt_len: int, vocab: int, groups: int = 0) -> list:
    """``slots`` random prompts of ``prompt_len`` ids; ``groups`` > 0: ``groups`` distinct prompts, each
    repeated ``slots // groups`` times in a row (a GRPO batch: 64 = 8 groups of 8)."""
    if not groups:
        return _prompts(slots, prompt_len, vocab)
    if slots % groups:
        raise ValueError(f"{slots} slots do not split into {groups} groups")
    return [p for p in _prompts(groups, prompt_len, vocab) for _ in range(slots // groups)]


def ours_runner(cfg, params, slots, prompt_len, new_tokens, dtype, scan_layers=True, decode_steps=1, groups=0):
    """A callable: one ``Generator.generate`` of ``slots`` prompts -> generated tokens/s
    (``groups``: :func:`grouped_prompts`)."""
    from rollout.engine import Qwen3Engine
    from rollout.generator import Generator

    eng = Qwen3Engine(cfg, params, slots=slots, max_cache_len=prompt_len + new_tokens + 1,
                      max_prefill_length=prompt_len, dtype=dtype, temperature=1.0,
                      model_kwargs=dict(scan_layers=scan_layers, attention="auto"), kv_layout="contiguous")
    gen = Generator(eng, decode_steps=decode_steps)
    prompts = grouped_prompts(slots, prompt_len, cfg.vocab_size, groups)
    seed = [0]

    def run() -> float:
        seed[0] += 1
        seeds = [seed[0] * 1000 + i for i in range(slots)]
        t = time.perf_counter()
        outs = gen.generate(prompts, max_new_tokens=new_tokens, seeds=seeds)
        dt = time.perf_counter() - t
        assert all(len(o.behav_logp) == len(o.tokens) == len(o.versions) for o in outs)
        return sum(len(o.tokens) for o in outs) / dt

    return run


def matmul_bound_runner(cfg, slots, new_tokens, dtype, decode_steps=4):
    """A callable -> tokens/s of a decode step reduced to its weight matmuls: for ``new_tokens``
    steps, ``[slots, d]`` rows through every layer's q, k, v, o, gate, up, down projections and the
    LM head (``[d, V]``), in ``dtype``, ``decode_steps`` steps per jitted call (a ``lax.scan``).
    No attention, norm, activation, sampling, cache or host work, so no decode step of this model
    in this dtype can make more tokens/s on this machine: an upper bound, not a decode."""
    import jax
    import jax.numpy as jnp

    D, L, V, F = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size, cfg.intermediate_size
    Hq, Hk = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    dt = jnp.dtype(dtype)
    key = iter(jax.random.split(jax.random.key(0), 7 * L + 2))

    def w(*shape):
        return (jax.random.normal(next(key), shape, jnp.float32) / np.sqrt(shape[0])).astype(dt)

    layers = [dict(q=w(D, Hq), k=w(D, Hk), v=w(D, Hk), o=w(Hq, D), g=w(D, F), u=w(D, F), d=w(F, D))
              for _ in range(L)]
    head = w(D, V)

    def step(x, _):
        for p in layers:
            q, k, v = x @ p["q"], x @ p["k"], x @ p["v"]
            # k, v feed the next layer's input so XLA cannot drop their dots
            x = (q @ p["o"] + (k.sum(-1, keepdims=True) + v.sum(-1, keepdims=True)).astype(dt) * 1e-3)
            x = (x @ p["g"] + x @ p["u"]) @ p["d"]
        logits = jnp.dot(x, head, preferred_element_type=jnp.float32)
        return (x + logits[:, :1].astype(dt) * 1e-3), None

    calls = jax.jit(lambda x: jax.lax.scan(step, x, None, length=decode_steps)[0])
    x0 = w(slots, D)
    n_calls = max(1, new_tokens // decode_steps)

    def run() -> float:
        t = time.perf_counter()
        x = x0
        for _ in range(n_calls):
            x = calls(x)
        jax.block_until_ready(x)
        return n_calls * decode_steps * slots / (time.perf_counter() - t)

    return run


def hf_runner(model, slots, prompt_len, new_tokens, vocab):
    import torch

    ids = torch.tensor(_prompts(slots, prompt_len, vocab), dtype=torch.long)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, use_cache=True,
              pad_token_id=0, eos_token_id=None)

    def run() -> float:
        with torch.no_grad():
            t = time.perf_counter()
            out = model.generate(ids, **kw)
            dt = time.perf_counter() - t
        return (out.shape[1] - prompt_len) * slots / dt

    # torch's thread count: the faster of 1 and all cores (on a loaded machine OpenMP
    # oversubscription can make the multi-threaded run many times slower, which would flatter us)
    best = None
    for n in sorted({1, os.cpu_count() or 1}):
        torch.set_num_threads(n)
        run()  # warm-up at this thread count
        r = run()
        if best is None or r > best[1]:
            best = (n, r)
    torch.set_num_threads(best[0])
    run.threads = best[0]
    return run


def tunix_runner(tmodel, cfg, slots, prompt_len, new_tokens, groups=0):
    """A callable: one Tunix ``Sampler`` call (batched prefill + decode loop) of ``slots`` prompts ->
    generated tokens/s (``groups``: :func:`grouped_prompts`)."""
    sampler = _tunix.make_sampler(tmodel, cfg, cache_size=prompt_len + new_tokens)
    prompts = grouped_prompts(slots, prompt_len, cfg.vocab_size, groups)
    seed = [0]

    def run() -> float:
        seed[0] += 1
        t = time.perf_counter()
        n, out = _tunix.sample(sampler, prompts, new_tokens, seed=seed[0])
        dt = time.perf_counter() - t
        assert out.logprobs is not None and len(out.logprobs[0]) == new_tokens
        return n / dt

    return run


def _decode_roofline(env: dict, cfg, slots: int, prompt_len: int, new_tokens: int, dtype: str):
    """Tokens/s at the chip's HBM bandwidth for ``new_tokens`` decode steps of ``slots`` slots from
    ``prompt_len`` cached positions (weights once + each slot's K/V per step, ``decode_hlo.roofline_bytes``;
    prefill not counted), or None off an accelerator."""
    if not env.get("hbm_bandwidth"):
        return None
    from decode_hlo import roofline_bytes

    item = 2 if dtype == "bfloat16" else 4
    total = sum(roofline_bytes(cfg, slots, prompt_len + i, item)["total"] for i in range(new_tokens))
    return decode_roofline(env, total, slots * new_tokens)


def parse_args(argv=None) -> argparse.Namespace:
    """The bench's command line: model preset, prompt / new tokens, slot counts, dtypes, rounds, scan, decode
    steps, which rows to skip, the matmul bound, ``--platform``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="small", help="small (the issue's reference Qwen3) or a jax_rl preset")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--slots", default="1,8,32")
    p.add_argument("--dtypes", default="bfloat16,float32", help="jax-rl rollout dtypes (rollout.dtype default: bfloat16)")
    p.add_argument("--tunix-dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--rounds", type=int, default=5, help="interleaved measured rounds per slot count")
    p.add_argument("--scan-layers", choices=("true", "false"), default="true",
                   help="stacked + scanned decoder layers (model.scan_layers; default true)")
    p.add_argument("--decode-steps", default="1",
                   help="jax-rl decode steps per engine call (rollout.decode_steps); comma list = one column each")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers row")
    p.add_argument("--no-tunix", action="store_true", help="skip the Tunix row")
    p.add_argument("--matmul-bound", action="store_true",
                   help="also time, per --dtypes, the decode step's weight matmuls alone (an upper bound on "
                        "tokens/s in that dtype on this machine; see matmul_bound_runner)")
    add_platform_arg(p)
    return p.parse_args(argv)


def load_models(a: argparse.Namespace, cfg, scan: bool, tunix_err: str | None):
    """The one checkpoint every side loads (written to a temporary folder): ``(HF model or None, jax-rl params,
    Tunix model or None)``; prints how far Tunix's logits are from jax-rl's fp32 ones."""
    import tempfile

    from jax_rl.models import hf_io
    from jax_rl.runtime.serve import config_and_params

    with tempfile.TemporaryDirectory() as d:
        hf = _checkpoint(cfg, d, use_hf=not a.no_hf)
        ours_model, _ = hf_io.load_pretrained(d, scan_layers=scan)
        _, params = config_and_params(ours_model)
        tmodel = None
        if tunix_err is None:
            tmodel = _tunix.load_model(d, cfg, a.tunix_dtype)
            probe = np.asarray(_prompts(2, 24, cfg.vocab_size))
            print(f"tunix {_tunix.version()}: same checkpoint folder, max |dlogits| vs jax-rl fp32 = "
                  f"{_tunix.max_logit_diff(tmodel, ours_model, probe):.2e}")
        else:
            print(f"Tunix Sampler: {tunix_err}")
    return hf, params, tmodel


def measure_slots(a: argparse.Namespace, cfg, params, hf, tmodel, ours: list, bounds: list, names: list[str],
                  env: dict) -> dict[int, dict]:
    """Per slot count, every row's runner timed interleaved (:func:`_tunix.interleaved`), a table row printed as
    it ends (with the HBM roofline on an accelerator); returns ``{slots: {row: [tokens/s per round]}}``."""
    scan = a.scan_layers == "true"
    steps = [int(n) for n in a.decode_steps.split(",")]
    w = 26
    print(f"{'slots':>5} " + " ".join(f"{n:>{w}}" for n in names))
    results = {}
    for s in [int(s) for s in a.slots.split(",")]:
        runners = {name: ours_runner(cfg, params, s, a.prompt_len, a.new_tokens, dt, scan, n) for dt, n, name in ours}
        if not a.no_hf:
            runners["HF generate fp32"] = hf_runner(hf, s, a.prompt_len, a.new_tokens, cfg.vocab_size)
        if tmodel is not None:
            runners[f"Tunix Sampler {a.tunix_dtype}"] = tunix_runner(tmodel, cfg, s, a.prompt_len, a.new_tokens)
        for dt, name in bounds:
            runners[name] = matmul_bound_runner(cfg, s, a.new_tokens, dt, steps[-1])
        res = _tunix.interleaved(runners, a.rounds)
        results[s] = res
        if "HF generate fp32" in runners:
            print(f"      (torch threads for HF generate at {s} slots: {runners['HF generate fp32'].threads})")
        print(f"{s:>5} " + " ".join(f"{_tunix.summary(res[n]):>{w}}" for n in names), flush=True)
        for dt, _, name in ours:  # on an accelerator: beside the HBM roofline of this decode
            rl = _decode_roofline(env, cfg, s, a.prompt_len, a.new_tokens, dt)
            if rl:
                print(f"      {name}: {statistics.median(res[name]):,.0f} tokens/s = "
                      f"{statistics.median(res[name]) / rl:.1%} of the HBM roofline {rl:,.0f} tokens/s "
                      f"({env['chip']}, {env['hbm_bandwidth'] / 1e12:.2f} TB/s)")
    return results


def print_ratios(a: argparse.Namespace, results: dict[int, dict], ours: list, bounds: list, tmodel,
                 tunix_err: str | None) -> None:
    """Per slot count, the medians' ratios: each jax-rl column over HF and Tunix, decode steps over the first,
    the matmul bounds."""
    steps = [int(n) for n in a.decode_steps.split(",")]
    dtypes = a.dtypes.split(",")
    med = {s: {k: statistics.median(v) for k, v in r.items()} for s, r in results.items()}
    for s in [int(s) for s in a.slots.split(",")]:
        m = med[s]
        parts = []
        for _, _, name in ours:
            if "HF generate fp32" in m:
                parts.append(f"{name} / HF = {m[name] / m['HF generate fp32']:.2f}x")
            tk = f"Tunix Sampler {a.tunix_dtype}"
            if tk in m:
                parts.append(f"{name} / Tunix = {m[name] / m[tk]:.2f}x")
        if len(steps) > 1:
            for dt in dtypes:
                base = f"jax-rl {dt} ds{steps[0]}"
                parts += [f"{dt} ds{n} / ds{steps[0]} = {m[f'jax-rl {dt} ds{n}'] / m[base]:.2f}x" for n in steps[1:]]
        for dt, name in bounds:
            parts.append(f"{name} = {m[name]:,.0f} tokens/s (the most any {dt} decode could make here)")
            if "HF generate fp32" in m:
                parts.append(f"{name} / HF = {m[name] / m['HF generate fp32']:.2f}x")
        if tmodel is None:
            parts.append(f"Tunix: {tunix_err}")
        print(f"{s:>5} slots: " + "; ".join(parts))


def main(argv=None) -> int:
    """The bench: the model, every row's runner per slot count interleaved, the tokens/s table, the ratios."""
    a = parse_args(argv)
    scan = a.scan_layers == "true"
    cfg = _config(a.preset)
    tunix_err = "skipped: --no-tunix" if a.no_tunix else _tunix.import_error()
    dtypes = a.dtypes.split(",")
    steps = [int(n) for n in a.decode_steps.split(",")]
    # one jax-rl column per (dtype, decode_steps): "bfloat16" or, with several, "bfloat16 ds8"
    ours = [(dt, n, f"jax-rl {dt}" + (f" ds{n}" if len(steps) > 1 else "")) for dt in dtypes for n in steps]
    print(f"preset={a.preset} (V={cfg.vocab_size} d={cfg.hidden_size} layers={cfg.num_hidden_layers} "
          f"heads={cfg.num_attention_heads}/{cfg.num_key_value_heads}x{cfg.head_dim} ff={cfg.intermediate_size}; "
          f"scan_layers={a.scan_layers}); prompt_len={a.prompt_len} new_tokens={a.new_tokens}; temperature 1")
    env = environment()  # versions, backend, devices, chip
    print(f"pid {os.getpid()}; date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"load before: {_tunix.machine_load()}")
    hf, params, tmodel = load_models(a, cfg, scan, tunix_err)
    print(f"jax-rl decode_steps (tokens per jitted call): {a.decode_steps}")
    bounds = [(dt, f"{dt} matmuls only") for dt in dtypes] if a.matmul_bound else []
    names = [name for _, _, name in ours] + ([] if a.no_hf else ["HF generate fp32"]) + \
        ([] if tmodel is None else [f"Tunix Sampler {a.tunix_dtype}"]) + [name for _, name in bounds]
    print(f"measured in this one process, interleaved per slot count, {a.rounds} rounds after one warm-up each: "
          + ", ".join(names))
    print("tokens/s: median [min-max] over rounds\n")
    results = measure_slots(a, cfg, params, hf, tmodel, ours, bounds, names, env)
    print()
    print_ratios(a, results, ours, bounds, tmodel, tunix_err)
    print(f"\nload after: {_tunix.machine_load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
