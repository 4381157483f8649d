"""Compile-time memory traffic of the rollout sampler (``rollout.engine.sample_tokens``) on a TPU
topology (libtpu AOT, no TPU), in passes over the ``[slots, vocab]`` fp32 logits.

Usage::

    JAX_PLATFORMS=cpu .venv/bin/python bench/sampler_passes.py --slots 128 --vocab 151936 --topology v5p-8

Compiles ``sample_tokens`` alone (logits [B, V] fp32 -> tokens, behav_logp, kept mass) for one chip of
``--topology`` with memory-space assignment off (``jax_rl.tpu.HBM_SIDE_OPTIONS``: every access an
HBM access) and prints, per truncation setting, the compiler's ``bytes accessed / (B * V * 4)``:
1.0 = the logits read once. Compile-time estimates, not TPU measurements.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SETTINGS = (("untruncated", 0, 1.0), ("top_k=50", 50, 1.0), ("top_p=0.9", 0, 0.9), ("top_k=50,top_p=0.9", 50, 0.9))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--topology", default="v5p-8")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from jax_rl.tpu import HBM_SIDE_OPTIONS, get_topology, no_persistent_cache, program_analysis
    from rollout.engine import sample_tokens

    B, V = args.slots, args.vocab
    sh = jax.sharding.SingleDeviceSharding(get_topology(args.topology).devices[0])
    shapes = ((B, V), jnp.float32), ((B, 2), jnp.uint32), ((B,), jnp.float32)
    abstract = [jax.ShapeDtypeStruct(s, d, sharding=sh) for s, d in shapes]
    print(f"sample_tokens, B={B} V={V}, {args.topology} (one chip), MSA off, jax {jax.__version__}")
    for name, k, p in SETTINGS:
        fn = jax.jit(functools.partial(sample_tokens, top_k=k, top_p=p))
        with no_persistent_cache():
            a = program_analysis(fn.lower(*abstract).compile(compiler_options=HBM_SIDE_OPTIONS))
        print(f"  {name:20s} passes over [B, V] fp32 = {a['bytes_accessed'] / (B * V * 4):6.2f}")


if __name__ == "__main__":
    main()
