"""Bare Qwen3 model speed on one device: jitted fwd+bwd of the mean sequence log-prob, forward
alone, and one decode step, for the ``tiny`` / ``small`` configs of ``bench/learner_step.py``.

    .venv/bin/python bench/model_step.py [--configs tiny,small] [--B 8] [--T 256] [--reps 5]
        [--decode-slots 32] [--decode-len 320] [--hlo DIR]

Prints median seconds and tokens/s for each. ``--hlo DIR`` writes the optimized HLO of the
fwd+bwd to DIR (to look for waste). Numbers depend on the machine's load: compare runs back
to back.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jax_rl.learner.logprobs import sequence_logprobs  # noqa: E402
from jax_rl.models import qwen3 as q  # noqa: E402

from _record import SMALL_DIMS  # noqa: E402  (bench/, the script's own directory)

CONFIGS = {
    "tiny": {},
    "small": {"vocab_size": 1024, **SMALL_DIMS},
}


def _median(fn, *args, reps: int) -> float:
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="tiny,small")
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--T", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--decode-slots", type=int, default=32)
    ap.add_argument("--decode-len", type=int, default=320)
    ap.add_argument("--remat", action="store_true")
    ap.add_argument("--scan", action="store_true", help="model.scan_layers layout")
    ap.add_argument("--remat-policy", default=None, help="MaxText remat policy name")
    ap.add_argument("--hlo", default=None)
    args = ap.parse_args()
    print(f"load {os.getloadavg()[0]:.1f}  B={args.B} T={args.T}  median of {args.reps}")
    for name in args.configs.split(","):
        cfg = q.get_preset("tiny_dense", **CONFIGS[name])
        model = q.Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0), remat=args.remat,
                                   scan_layers=args.scan, remat_policy=args.remat_policy)
        graphdef, params = nnx.split(model)
        rng = np.random.default_rng(0)
        tok = jnp.asarray(rng.integers(0, cfg.vocab_size, (args.B, args.T)), jnp.int32)
        am = jnp.ones((args.B, args.T), bool)

        def loss(p):
            return -jnp.mean(sequence_logprobs(graphdef, p, tok, am).logp)

        fb = jax.jit(jax.value_and_grad(loss))
        fw = jax.jit(loss)
        if args.hlo:
            os.makedirs(args.hlo, exist_ok=True)
            with open(os.path.join(args.hlo, f"{name}_fwdbwd.txt"), "w") as f:
                f.write(fb.lower(params).compile().as_text())
        t0 = time.perf_counter()
        jax.block_until_ready(fb(params))
        c = time.perf_counter() - t0
        t_fb = _median(fb, params, reps=args.reps)
        t_fw = _median(fw, params, reps=args.reps)
        ntok = args.B * args.T
        print(f"{name:6} fwd+bwd {t_fb * 1e3:8.1f} ms {ntok / t_fb:9.0f} tok/s (compile {c:.1f}s) | "
              f"fwd {t_fw * 1e3:8.1f} ms {ntok / t_fw:9.0f} tok/s")

        S = args.decode_len
        cache = model.init_cache(args.decode_slots, S)
        cache = cache.replace(lengths=jnp.full((args.decode_slots,), S // 2, jnp.int32))
        toks = jnp.zeros((args.decode_slots,), jnp.int32)

        @jax.jit
        def dec(p, toks, cache):
            m = nnx.merge(graphdef, p)
            return m.decode_step(toks, cache)

        t_d = _median(dec, params, toks, cache, reps=args.reps * 4)
        print(f"{name:6} decode step ({args.decode_slots} slots, S={S}) {t_d * 1e3:8.2f} ms "
              f"{args.decode_slots / t_d:9.0f} tok/s")


if __name__ == "__main__":
    main()
