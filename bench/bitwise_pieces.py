"""Which pieces of the Qwen3 forward are batch-invariant on this backend (issue 62, step 1).

Usage::

    .venv/bin/python bench/bitwise_pieces.py [--dtype float32|bfloat16] [--big 256]

For each piece, rows (tokens) computed in calls of different compositions are compared bit for bit with the
same rows inside one ``--big``-row call; the script prints the count of differing output elements (0 =
invariant in that composition). Shapes are the tiny models' (``tiny_dense``: d 64, 4 q / 2 kv heads of 16,
mlp 128, vocab 384; the ``make train`` model: 2 q / 1 kv heads of 64, vocab 640) plus one wider one.

Pieces:

- ``matmul KxN M=m``: ``x[:m] @ w`` alone vs rows ``:m`` of ``x @ w`` (the projections, the LM head).
- ``matmul tile64 pos``: rows in a call padded to a 64-row tile, at another position of the tile.
- ``rmsnorm`` / ``log_softmax`` / ``router``: the per-row reductions (mean of squares, logsumexp over V,
  the router's softmax + top-k) by row count.
- ``attend decode vs T``: today's XLA attention, 1 query (decode) vs the same query inside a causal T-query
  call over the same keys, and decode over a longer (padded, masked) key bucket.
- ``chunked decode vs T`` / ``chunked bucket``: the batch-invariant candidate (:func:`jax_rl.models.bitwise.
  chunked_attend`, fixed 16-key chunks, online softmax in chunk order), the same two comparisons.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np


def _diff(a, b) -> int:
    a, b = np.asarray(a), np.asarray(b)
    return int(np.sum(a.view(np.uint8 if a.dtype.itemsize == 1 else f"u{a.dtype.itemsize}")
                      != b.view(np.uint8 if b.dtype.itemsize == 1 else f"u{b.dtype.itemsize}")))


def matmuls(dt, big: int) -> list[tuple[str, int]]:
    out = []
    mm = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32))
    for K, N in ((64, 128), (128, 64), (64, 384), (64, 640), (128, 64 * 8), (1024, 1024)):
        kx, kw = jax.random.split(jax.random.key(K * 7 + N))
        x = jax.random.normal(kx, (big, K), jnp.float32).astype(dt)
        w = (jax.random.normal(kw, (K, N), jnp.float32) / K ** 0.5).astype(dt)
        ref = mm(x, w)
        for m in (1, 2, 3, 8, 16, 32, 63, 64, 65, 128):
            out.append((f"matmul {K}x{N} M={m}", _diff(mm(x[:m], w), ref[:m])))
        xt = jnp.zeros((64, K), dt).at[37:45].set(x[:8])  # 8 rows at rows 37..44 of a 64-row tile
        out.append((f"matmul {K}x{N} tile64 pos", _diff(mm(xt, w)[37:45], ref[:8])))
        xs = jnp.zeros((64, K), dt).at[:8].set(x[:8]).at[8:].set(x[100:156])  # other rows share the tile
        out.append((f"matmul {K}x{N} tile64 mates", _diff(mm(xs, w)[:8], ref[:8])))
    return out


def rows(dt, big: int) -> list[tuple[str, int]]:
    from jax_rl.models.qwen3.layers import RMSNorm  # lazy: bench only

    out = []
    norm = RMSNorm(64, 1e-6)
    rn = jax.jit(lambda x: norm(x))
    ls = jax.jit(lambda z: jax.nn.log_softmax(z.astype(jnp.float32), axis=-1))

    def route(x, w):
        p = jax.nn.softmax(jnp.dot(x, w, preferred_element_type=jnp.float32), axis=-1)
        return jax.lax.top_k(p, 2)[0]
    rt = jax.jit(route)
    x = jax.random.normal(jax.random.key(1), (big, 64), jnp.float32).astype(dt)
    z = jax.random.normal(jax.random.key(2), (big, 640), jnp.float32) * 3
    wr = jax.random.normal(jax.random.key(3), (64, 4), jnp.float32).astype(dt)
    for m in (1, 2, 8, 63, 64, 65):
        out.append((f"rmsnorm d64 M={m}", _diff(rn(x[:m]), rn(x)[:m])))
        out.append((f"log_softmax V640 M={m}", _diff(ls(z[:m]), ls(z)[:m])))
        out.append((f"router E4 M={m}", _diff(rt(x[:m], wr), rt(x, wr)[:m])))
    return out


def attention(dt) -> list[tuple[str, int]]:
    from jax_rl.models.bitwise import chunked_attend  # lazy: bench only
    from jax_rl.models.xla_attention import attend, attend_causal  # lazy: bench only

    out = []
    for (N, K, H) in ((4, 2, 16), (2, 1, 64)):
        T = 96
        kq, kk, kv = jax.random.split(jax.random.key(N * H), 3)
        q = jax.random.normal(kq, (2, T, N, H), jnp.float32).astype(dt)
        k = jax.random.normal(kk, (2, T, K, H), jnp.float32).astype(dt)
        v = jax.random.normal(kv, (2, T, K, H), jnp.float32).astype(dt)
        causal = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (2, T, T))
        full = jax.jit(attend_causal)(q, k, v, causal)
        dec = jax.jit(attend)
        pos = jnp.arange(T)
        chunked = jax.jit(chunked_attend)
        full_c = chunked(q, k, v, jnp.broadcast_to(pos, (2, T)))
        n_d = n_b = n_cd = n_cb = 0
        kpad = jnp.pad(k, ((0, 0), (0, 64), (0, 0), (0, 0)))
        vpad = jnp.pad(v, ((0, 0), (0, 64), (0, 0), (0, 0)))
        for t in (0, 5, 17, 40, 95):
            m = (jnp.arange(T) <= t)[None, None, :].repeat(2, 0)
            o1 = dec(q[:, t:t + 1], k, v, m)
            n_d += _diff(o1[:, 0], full[:, t])
            mp = (jnp.arange(T + 64) <= t)[None, None, :].repeat(2, 0)
            n_b += _diff(dec(q[:, t:t + 1], kpad, vpad, mp), o1)
            c1 = chunked(q[:, t:t + 1], k, v, jnp.full((2, 1), t))
            n_cd += _diff(c1[:, 0], full_c[:, t])
            cb = chunked(q[:, t:t + 1], kpad, vpad, jnp.full((2, 1), t))
            n_cb += _diff(cb, c1)
        tag = f"N{N}K{K}H{H}"
        nq = 0  # no query-row tile: decode's G rows against the learner's G*T
        untiled = jax.jit(lambda q, k, v, p: chunked_attend(q, k, v, p, q_tile=1))
        full_u = untiled(q, k, v, jnp.broadcast_to(pos, (2, T)))
        for t in (0, 5, 17, 40, 95):
            nq += _diff(untiled(q[:, t:t + 1], k, v, jnp.full((2, 1), t))[:, 0], full_u[:, t])
        out.append((f"chunked q_tile=1 decode vs T {tag}", nq))
        out += [(f"attend decode vs T {tag}", n_d), (f"attend decode bucket+64 {tag}", n_b),
                (f"chunked decode vs T {tag}", n_cd), (f"chunked bucket+64 {tag}", n_cb)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--big", type=int, default=256)
    ap.add_argument("--only", default="matmul,rows,attention")
    a = ap.parse_args()
    dt = jnp.dtype(a.dtype)
    print(f"jax {jax.__version__} backend {jax.default_backend()} dtype {dt.name}: differing elements")
    parts = {"matmul": lambda: matmuls(dt, a.big), "rows": lambda: rows(dt, a.big), "attention": lambda: attention(dt)}
    for name in a.only.split(","):
        for label, n in parts[name]():
            print(f"  {label:40s} {n}")


if __name__ == "__main__":
    main()
