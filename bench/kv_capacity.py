"""How many concurrent episodes one TPU chip holds, contiguous K/V against paged, from the TPU compiler.

Usage::

    JAX_PLATFORMS=cpu .venv/bin/python bench/kv_capacity.py [--topology v5p-8] [--reserve 16384] \\
        [--prefix 4818] [--unique 3072] [--points 8,16] [--layers 0]

The model is Qwen3-8B's shape (HF: hidden 4,096, 36 layers, 32 heads, 8 KV heads of 128, MLP 12,288,
vocab 151,936, untied; bf16: 144 KiB of K/V per token) at the tau² retail shape: every episode starts
with the domain's system prompt and tool schemas (``--prefix`` tokens: 4,818 under the Qwen3 tokenizer,
``configs/tau2_retail.yaml``'s note) and adds ``--unique`` tokens of its own by its end (turns, tool
results, user messages; 3,072 is a long retail episode: 1,024 generated tokens, the rest tool and user
text). For each layout the engine's decode step (decode + sampling + ``behav_logp``: what runs while
episodes are in flight) is compiled for one chip at two sizes, and the compiler's ``memory_analysis``
(arguments + outputs - aliases + temporaries, bytes per chip) is fitted as ``fixed + per_episode x n``:

- ``contiguous``: ``Qwen3Engine``'s ``generate`` (stacked cache) with ``rollout.max_cache_len =
  --reserve`` positions reserved per slot: each episode holds a whole reservation, its prompt copied in;
- ``paged``: the paged decode step over one pool that holds the prefix once (its pages shared by
  reference: one copy per weight version in flight, ``--versions``) and each episode's own pages
  (``ceil(unique / page_size) + 1``, the last partial page copied on write).

The capacity is the largest ``n`` with ``fixed + per_episode x n`` within the chip's HBM (``jax_rl.chips``).
Compile-time estimates on a CPU host (libtpu's AOT compiler): never a measured TPU memory or time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
from _record import ROOT  # noqa: E402,F401  (the bench preamble: the repository first on sys.path)


def qwen3_8b(layers: int = 0):
    """Qwen3-8B's config (HF ``Qwen/Qwen3-8B`` config.json fields), ``layers`` overriding the depth."""
    from jax_rl.models.qwen3 import get_preset

    cfg = get_preset("qwen3_4b", hidden_size=4096, intermediate_size=12288, tie_word_embeddings=False)
    return cfg.replace(num_hidden_layers=layers) if layers else cfg


def _peak(compiled) -> int:
    from jax_rl.tpu.analysis import program_analysis

    return int(program_analysis(compiled)["peak_bytes_per_chip"])


def contiguous_peak(cfg, slots: int, reserve: int, topology: str) -> int:
    """Peak bytes per chip of the contiguous engine's decode step (``decode_hlo.compile_generate``)."""
    from decode_hlo import compile_generate

    compiled, _ = compile_generate(cfg, slots=slots, cache=reserve, layout="stacked", dtype="bfloat16",
                                   backend="tpu", topology=topology)
    return _peak(compiled)


def paged_peak(cfg, slots: int, reserve: int, prefix: int, unique: int, page_size: int, versions: int,
               topology: str) -> int:
    """Peak bytes per chip of the paged decode step (``decode_hlo.compile_paged``, the TPU kernel path; the page
    table spans ``reserve``) over a pool of ``versions x ceil(prefix / page) + slots x (ceil(unique / page) + 1)``
    pages: the prefix held once per weight version, each episode's own pages."""
    from decode_hlo import compile_paged
    from jax_rl.models.paged_attention import pages_for
    from rollout.engine import EngineSpec

    n_pages = versions * pages_for(prefix, page_size) + slots * (pages_for(unique, page_size) + 1)
    spec = EngineSpec(slots=slots, max_cache_len=reserve, dtype="bfloat16", kv_layout="paged", kv_page_size=page_size,
                      kv_pages=n_pages)
    compiled, _ = compile_paged(cfg, spec, live=prefix + unique, backend="tpu", topology=topology)
    return _peak(compiled)


def fit(points: list[tuple[int, int]]) -> tuple[float, float]:
    """``(fixed, per_episode)`` bytes through two ``(episodes, peak bytes)`` points."""
    (n1, b1), (n2, b2) = points[0], points[-1]
    per = (b2 - b1) / (n2 - n1)
    return b1 - per * n1, per


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--topology", default="v5p-8", help="one chip of this topology")
    p.add_argument("--reserve", type=int, default=16384, help="contiguous: rollout.max_cache_len per slot")
    p.add_argument("--prefix", type=int, default=4818, help="shared system prompt + tool schemas (tokens)")
    p.add_argument("--unique", type=int, default=3072, help="an episode's own tokens by its end")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--versions", type=int, default=2, help="weight versions whose prefix pages are held at once")
    p.add_argument("--points", default="8,16", help="two episode counts to compile each layout at")
    p.add_argument("--layers", type=int, default=0, help="depth override (0 = Qwen3-8B's 36)")
    p.add_argument("--json", default=None, help="also write the figures here")
    a = p.parse_args(argv)
    from jax_rl import chips

    cfg = qwen3_8b(a.layers)
    hbm = chips.CHIPS[a.topology.split("-")[0].split(":")[0]].hbm_bytes
    pts = [int(x) for x in a.points.split(",")]
    kv_tok = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    out = dict(model="Qwen3-8B shape", layers=cfg.num_hidden_layers, topology=a.topology, hbm_bytes=hbm,
               kv_bytes_per_token=kv_tok, reserve=a.reserve, prefix=a.prefix, unique=a.unique,
               page_size=a.page_size, versions=a.versions,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
               what="compile-time estimate (libtpu AOT on a CPU host), not a TPU measurement")
    print(f"{out['model']}, {cfg.num_hidden_layers} layers, bf16: {kv_tok / 1024:.0f} KiB of K/V per token; "
          f"one {a.topology} chip: {hbm / 2**30:.1f} GiB HBM", flush=True)
    peak_of = {"contiguous": lambda n: contiguous_peak(cfg, n, a.reserve, a.topology),
               "paged": lambda n: paged_peak(cfg, n, a.reserve, a.prefix, a.unique, a.page_size, a.versions, a.topology)}
    for layout, peak in peak_of.items():
        peaks = []
        for n in pts:
            b = peak(n)
            peaks.append((n, b))
            print(f"  {layout}: {n} episodes -> {b / 2**30:.2f} GiB peak per chip", flush=True)
        fixed, per = fit(peaks)
        cap = math.floor((hbm - fixed) / per) if per > 0 else None
        out[layout] = dict(points=peaks, fixed_bytes=fixed, per_episode_bytes=per, episodes=cap)
        print(f"{layout}: fixed {fixed / 2**30:.2f} GiB + {per / 2**30:.3f} GiB per episode -> {cap} episodes "
              f"fit one chip", flush=True)
    if out["contiguous"]["episodes"] and out["paged"]["episodes"]:
        out["ratio"] = out["paged"]["episodes"] / out["contiguous"]["episodes"]
        print(f"paged / contiguous: {out['ratio']:.2f}x the concurrent episodes")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
