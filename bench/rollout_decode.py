"""Decode throughput: our Generator/Qwen3Engine at 1, 8, 32 slots vs transformers ``generate``.

Usage: ``.venv/bin/python bench/rollout_decode.py [--new-tokens 64] [--prompt-len 16] [--preset tiny_dense]
[--scan-layers true|false]``

Both sides run the same architecture (``--preset``; default ``tiny_dense``: d=64, 2 layers,
V=384) with the same weights (the HF model is built first and our params are converted from its
state dict through ``jax_rl.models.hf_io`` when that module exists, else both are random inits
of the same config). Each measurement generates ``new_tokens`` tokens for each of ``batch``
prompts of ``prompt_len`` tokens, no early stop, after one warm-up run (compilation excluded),
and reports generated tokens / wall second (prefill included on both sides).
transformers: torch fp32, ``use_cache=True``, greedy, batch = slots. ``--scan-layers`` (default
``true``, the ``model.scan_layers`` default ``jax-rl train`` uses): our engine's decoder layers
stacked and scanned, else unrolled.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402


def _hf_model(cfg):
    import torch
    import transformers

    hf_cfg = transformers.Qwen3Config(**{k: v for k, v in cfg.to_hf().items() if k not in ("architectures", "model_type", "dtype", "torch_dtype")})
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(hf_cfg).eval().float()


def _our_params(cfg, hf_model, tmpdir, scan_layers: bool):
    from flax import nnx

    from jax_rl.models import qwen3 as q

    try:
        from jax_rl.models import hf_io  # noqa: F401
        from rollout.serve import _config_and_params

        hf_model.save_pretrained(tmpdir)
        _, params = _config_and_params(hf_io.load_pretrained(tmpdir, scan_layers=scan_layers))
        return params, "same weights (hf_io)"
    except ImportError:
        model = q.Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0), scan_layers=scan_layers)
        return nnx.state(model, nnx.Param), "random init, same config"


def bench_ours(cfg, params, slots, prompt_len, new_tokens, dtype, reps=2, scan_layers=True):
    from rollout.engine import Qwen3Engine
    from rollout.generator import Generator

    eng = Qwen3Engine(cfg, params, slots=slots, max_cache_len=prompt_len + new_tokens + 1,
                      max_prefill_length=prompt_len, dtype=dtype, temperature=1.0,
                      model_kwargs=dict(scan_layers=scan_layers, attention="auto"))
    gen = Generator(eng)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(1, cfg.vocab_size, prompt_len)) for _ in range(slots)]
    gen.generate(prompts, max_new_tokens=new_tokens)  # warm-up / compile
    best = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        outs = gen.generate(prompts, max_new_tokens=new_tokens)
        dt = time.perf_counter() - t
        n = sum(len(o.tokens) for o in outs)
        best = max(best, n / dt)
    return best


def bench_hf(model, batch, prompt_len, new_tokens, vocab, reps=2):
    import torch

    rng = np.random.default_rng(0)
    ids = torch.tensor(rng.integers(1, vocab, (batch, prompt_len)), dtype=torch.long)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, use_cache=True,
              pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        model.generate(ids, **kw)  # warm-up
        best = 0.0
        for _ in range(reps):
            t = time.perf_counter()
            out = model.generate(ids, **kw)
            dt = time.perf_counter() - t
            best = max(best, (out.shape[1] - prompt_len) * batch / dt)
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny_dense")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--slots", default="1,8,32")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--scan-layers", choices=("true", "false"), default="true",
                   help="stacked + scanned decoder layers (model.scan_layers; default true)")
    a = p.parse_args(argv)
    scan = a.scan_layers == "true"
    import tempfile

    import jax

    from jax_rl.models import qwen3 as q

    cfg = q.get_preset(a.preset)
    hf = _hf_model(cfg)
    with tempfile.TemporaryDirectory() as d:
        params, how = _our_params(cfg, hf, d, scan)
    slots = [int(s) for s in a.slots.split(",")]
    dtypes = a.dtypes.split(",")
    print(f"preset={a.preset} ({how}; scan_layers={a.scan_layers}); prompt_len={a.prompt_len} new_tokens={a.new_tokens}; "
          f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} cpus")
    print(f"{'slots':>5} " + " ".join(f"{'jax-rl ' + dt:>18}" for dt in dtypes) + f" {'HF generate fp32':>18} {'ratio(' + dtypes[0] + ')':>16}")
    for s in slots:
        ours = [bench_ours(cfg, params, s, a.prompt_len, a.new_tokens, dt, scan_layers=scan) for dt in dtypes]
        theirs = bench_hf(hf, s, a.prompt_len, a.new_tokens, cfg.vocab_size)
        print(f"{s:>5} " + " ".join(f"{x:>14.0f} t/s" for x in ours) + f" {theirs:>14.0f} t/s {ours[0] / theirs:>15.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
