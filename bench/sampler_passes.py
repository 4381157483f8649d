"""Compile-time memory traffic of the rollout sampler (``rollout.engine.sample_tokens``) on a TPU
topology (libtpu AOT, no TPU), in passes over the ``[slots, vocab]`` fp32 logits.

Usage::

    JAX_PLATFORMS=cpu .venv/bin/python bench/sampler_passes.py --slots 128 --vocab 151936 --topology v5p-8

Compiles ``sample_tokens`` alone (logits [B, V] fp32 -> tokens, behav_logp, kept mass) for one chip of
``--topology`` with memory-space assignment off (``jax_rl.compile.HBM_SIDE_OPTIONS``: every access an
HBM access) and prints, per truncation setting, the compiler's ``bytes accessed / (B * V * 4)``:
1.0 = the logits read once. Compile-time estimates, not TPU measurements.

A truncated setting's program holds a ``lax.cond``: the candidate path (``lax.top_k`` of a bounded
set), and the full-vocabulary path taken only when the candidates do not hold a row's kept set.
``cost_analysis`` charges both branches; ``--branch candidates`` compiles the candidate path alone
(``lax.cond`` replaced by its true branch in this process), the cost of the step that runs.

``--impl kernel`` compiles the untruncated setting through the Pallas TPU kernel
(``rollout.engine.sampler_kernel``; truncated settings keep the XLA path). libtpu's ``cost_analysis``
does not count a Mosaic custom call's operands and results (it reports the program around it), so the
kernel's line adds the custom call's operand and result bytes, read from the compiled program's text,
to the compiler's count: the kernel reads each operand once (its BlockSpecs visit every row tile once).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def custom_call_bytes(hlo_text: str) -> int:
    """Operand plus result bytes of the compiled program's Mosaic calls (``tpu_custom_call``), by
    ``hlo_traffic.top_level_traffic`` (each operand's size from its own output shape)."""
    import hlo_traffic  # the bench folder is on sys.path when this runs as a script

    return sum(r["bytes"] for r in hlo_traffic.top_level_traffic(hlo_text) if r["target"] == "tpu_custom_call")


SETTINGS = (("untruncated", 0, 1.0), ("top_k=50", 50, 1.0), ("top_p=0.9", 0, 0.9), ("top_k=50,top_p=0.9", 50, 0.9))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--topology", default="v5p-8")
    ap.add_argument("--branch", choices=("both", "candidates"), default="both",
                    help="truncated settings: the whole program (both cond branches counted) or the candidate path")
    ap.add_argument("--settings", default=",".join(s[0] for s in SETTINGS), help="comma list of settings to compile")
    ap.add_argument("--impl", choices=("xla", "kernel"), default="xla",
                    help="the untruncated path: XLA, or the Pallas TPU kernel (module doc)")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from jax_rl.compile import HBM_SIDE_OPTIONS, get_topology, no_persistent_cache, program_analysis
    from rollout.engine import sample_tokens

    B, V = args.slots, args.vocab
    sh = jax.sharding.SingleDeviceSharding(get_topology(args.topology).devices[0])
    shapes = ((B, V), jnp.float32), ((B, 2), jnp.uint32), ((B,), jnp.float32)
    abstract = [jax.ShapeDtypeStruct(s, d, sharding=sh) for s, d in shapes]
    if args.branch == "candidates":
        jax.lax.cond = lambda pred, true_fn, false_fn, *ops: true_fn(*ops)  # the common path alone
    print(f"sample_tokens, B={B} V={V}, {args.topology} (one chip), MSA off, jax {jax.__version__}, "
          f"branch {args.branch}, impl {args.impl}", flush=True)
    for name, k, p in SETTINGS:
        if name not in args.settings.split(","):
            continue
        fn = jax.jit(functools.partial(sample_tokens, top_k=k, top_p=p, impl=args.impl))
        with no_persistent_cache():
            compiled = fn.lower(*abstract).compile(compiler_options=HBM_SIDE_OPTIONS)
        a = program_analysis(compiled)
        kernel = custom_call_bytes(compiled.as_text())
        line = f"  {name:20s} passes over [B, V] fp32 = {(a['bytes_accessed'] + kernel) / (B * V * 4):6.2f}"
        if kernel:
            line += (f"  (compiler's count {a['bytes_accessed']:,.0f} B without the Pallas call + the call's "
                     f"operands and results {kernel:,} B)")
        print(line, flush=True)


if __name__ == "__main__":
    main()
