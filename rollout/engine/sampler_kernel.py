"""The untruncated sampler as one Pallas TPU kernel: the ``[slots, vocab]`` logits read from HBM once.

:func:`sample_untruncated` is :func:`rollout.engine.sampler.sample_tokens` with ``top_k = 0`` and
``top_p = 1`` for a TPU. The XLA program reads the logits twice (the block statistics, then the draw's
and the greedy argmax's 128-wide block rows, ``sampler._select_rows``), because the inverse-CDF draw
needs the row's total mass before it reads a running sum; a gather for the second read costs more on a
TPU (the logits are laid out again for it: docs/performance.md, "The sampler's passes"). Here each grid
step copies 8 whole rows into VMEM (``[8, V]`` fp32: 4.9 MB at V = 151,936, double-buffered by the
pipeline) and makes every pass over them there, so HBM sees one read of the logits and a ``[B, 128]``
write of the results.

The random stream is the XLA path's: the same uniform ``u`` per row (drawn by the caller from the same
key), the inverse CDF in vocabulary order over ``exp(x / T - max)``, clamped to the last entry with
mass, and ``behav_logp = (x / T - max) - log(sum exp)`` (``jax.nn.log_softmax``'s formula); greedy rows
(``temperature <= 0``, T = 1) take the first argmax. Only the association of the running sums differs
(per-lane partial sums of 16-vreg groups, the group masses' running sum by a log-step scan, then the
vregs and the lanes of the group holding the draw), so a token equals the XLA path's except where
``u x total`` lies within fp32 rounding of a CDF boundary, and ``behav_logp`` agrees to ~1e-6.

Passes inside VMEM, per tile of 8 rows (``nb = V / 128`` vregs of ``[8, 128]``): (1) per-lane max and
first argmax of ``x / T``; (2) per-lane sums of ``exp(x / T - max)`` over each group of ``G`` vregs,
one lane reduction per group into a ``[8, 128]`` vector of group masses (``V / (128 G) <= 128``
groups); then the group holding the draw, and (3) that group's ``G`` vregs selected by a masked pass,
whose vreg masses (``G`` lane reductions) and one vreg's lane scan give the token. Only elementwise
ops, lane reductions and lane rolls: no gather, no reshape, no cumsum.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

__all__ = ["sample_untruncated", "kernel_fits"]

ROWS, LANES = 8, 128
_F32 = jnp.float32


# the double-buffered [8, V] fp32 row tile: within every TPU generation's VMEM (16 MiB per core on v4) with
# room for the kernel's temporaries (V = 262,144 did not compile for v4; 196,608 and 151,936 do)
TILE_VMEM_BUDGET = 12 << 20


def kernel_fits(V: int) -> bool:
    """Whether :func:`sample_untruncated` takes a vocabulary of ``V``: whole 128-lane vregs, and a
    double-buffered 8-row tile within :data:`TILE_VMEM_BUDGET` (V <= 196,608: Qwen3's 151,936 and
    Llama 3's 128,256 do; larger vocabularies keep the XLA path)."""
    return V > 0 and V % LANES == 0 and 2 * ROWS * V * 4 <= TILE_VMEM_BUDGET


def _group_size(nb: int) -> int:
    """Vregs per group: 16 (one lane reduction per 16 vregs), more when ``nb`` needs over 128 groups."""
    return min(nb, max(16, -(-nb // LANES)))


def _over_groups(nb: int, G: int, body, carry):
    """``body(g, j0, n, carry)`` over the groups of ``G`` vregs of a row tile (``n`` static: the group's
    vregs ``j0 .. j0 + n - 1``): a loop over the full groups, then the last, partial one."""
    nf, tail = divmod(nb, G)
    if nf:
        carry = jax.lax.fori_loop(0, nf, lambda g, c: body(g, g * G, G, c), carry)
    if tail:
        carry = body(nf, nf * G, tail, carry)
    return carry


def _lane_prefix(v: jax.Array, lane: jax.Array) -> jax.Array:
    """Inclusive running sum along the lanes of ``v`` [8, 128] (log-step scan of lane rolls). The
    rotation's direction is read from a rolled lane index, so the scan does not depend on it."""
    from jax.experimental.pallas import tpu as pltpu  # lazy: pallas (TPU extras) only where the kernel runs

    s = 1
    while s < LANES:
        src = pltpu.roll(lane, s, 1)
        moved = jnp.where(src == lane - s, pltpu.roll(v, s, 1), pltpu.roll(v, LANES - s, 1))
        v = v + jnp.where(lane >= s, moved, 0.0)
        s *= 2
    return v


def _lane_sum(v: jax.Array) -> jax.Array:
    """Sum over the lanes: [8, 128] -> [8, 1]."""
    return jnp.sum(v, axis=1, keepdims=True)


def _lane_at(v: jax.Array, lane: jax.Array, at: jax.Array) -> jax.Array:
    """``v[r, at[r]]`` [8, 1] (``at`` [8, 1] float lane index; 0 where it names no lane)."""
    return _lane_sum(jnp.where(lane == at, v, 0.0))


def _first_above(cdf: jax.Array, x: jax.Array, mass: jax.Array, lane: jax.Array) -> jax.Array:
    """The first lane whose running mass ``cdf`` exceeds ``x``, clamped to the last lane with ``mass``
    > 0 ([8, 1] float), as ``sampler._draw_block`` / ``_draw_in_block``."""
    last = jnp.max(jnp.where(mass > 0, lane, -1.0), axis=1, keepdims=True)
    return jnp.minimum(_lane_sum((cdf <= x).astype(_F32)), last)


def _max_pass(x_ref, inv_t, lanef, nb, G):
    """Pass 1: per lane the max of ``x / T`` and the first vreg holding it (inside a group the vreg's
    constant offset, then the group's base once: 4 vector ops per vreg); the row's max and first
    argmax [8, 1]."""
    def body(g, j0, n, c):
        m, jm = c
        mg, kg = jnp.full_like(m, -jnp.inf), jnp.zeros_like(m)
        for k, v in enumerate(_vregs(x_ref, j0, n)):
            y = v * inv_t
            kg = jnp.where(y > mg, float(k), kg)
            mg = jnp.maximum(mg, y)
        base = j0.astype(_F32) if not isinstance(j0, int) else float(j0)
        up = mg > m  # strictly: an earlier group keeps a tie
        return jnp.where(up, mg, m), jnp.where(up, base + kg, jm)

    m0 = jnp.full(lanef.shape, -jnp.inf, _F32)
    m, jm = _over_groups(nb, G, body, (m0, jnp.zeros(lanef.shape, _F32)))
    M = jnp.max(m, axis=1, keepdims=True)
    return M, jnp.min(jnp.where(m == M, jm * LANES + lanef, jnp.inf), axis=1, keepdims=True)


def _mass_pass(x_ref, inv_t, M, lane, nb, G):
    """Pass 2: the masses ``sum exp(x / T - M)`` of the groups, group ``g`` at lane ``g`` of [8, 128]."""
    def body(g, j0, n, gs):
        acc = jnp.zeros(lane.shape, _F32)
        for v in _vregs(x_ref, j0, n):
            acc = acc + jnp.exp(v * inv_t - M)
        return jnp.where(lane == g, _lane_sum(acc), gs)

    return _over_groups(nb, G, body, jnp.zeros(lane.shape, _F32))


def _select_pass(x_ref, grp, nb, G):
    """Pass 3: the raw logits of each row's group ``grp`` [8, 1] (float): ``G`` vregs, ``-inf`` past
    a partial last group."""
    shape = (x_ref.shape[0], LANES)

    def body(g, j0, n, sel):
        hit = grp == g.astype(_F32) if not isinstance(g, int) else grp == float(g)
        vs = _vregs(x_ref, j0, n)
        return tuple(jnp.where(hit, vs[k], s) if k < n else s for k, s in enumerate(sel))

    return _over_groups(nb, G, body, tuple(jnp.full(shape, -jnp.inf, _F32) for _ in range(G)))


def _vregs(x_ref, j0, n: int) -> list[jax.Array]:
    """The ``n`` vregs ``[8, 128]`` of lanes ``[128 j0, 128 (j0 + n))`` of a row tile (``j0`` static or
    traced): one load at one address, sliced statically (no address arithmetic per vreg)."""
    from jax.experimental import pallas as pl  # lazy: pallas only where the kernel runs

    start = j0 * LANES if isinstance(j0, int) else pl.multiple_of(j0 * LANES, LANES)
    block = x_ref[:, pl.ds(start, n * LANES)]
    return [block[:, k * LANES:(k + 1) * LANES] for k in range(n)]


def _in_group(sel, inv_t, M, prev_g, x, lane):
    """The draw inside the selected group: the vreg ``kk`` (running sums of the ``G`` vreg masses from
    ``prev_g``), then the lane ``i`` (scan of that vreg's masses); ``(kk, i, x / T at the token)``."""
    ys = [s * inv_t for s in sel]
    es = [jnp.exp(y - M) for y in ys]
    kk = jnp.zeros_like(M)
    last = jnp.full_like(M, -1.0)
    c = prev_g
    cum = []
    for k, e in enumerate(es):
        bs = _lane_sum(e)
        c = c + bs
        cum.append(c)
        kk = kk + (c <= x).astype(_F32)
        last = jnp.where(bs > 0, float(k), last)
    kk = jnp.minimum(kk, last)
    prev_k = jnp.where(kk == 0, prev_g, 0.0)
    e_row = jnp.zeros_like(es[0])
    y_row = jnp.zeros_like(ys[0])
    for k in range(len(es)):
        prev_k = jnp.where(kk == k + 1, cum[k], prev_k)
        e_row = jnp.where(kk == k, es[k], e_row)
        y_row = jnp.where(kk == k, ys[k], y_row)
    i = _first_above(prev_k + _lane_prefix(e_row, lane), x, e_row, lane)
    return kk, i, _lane_at(y_row, lane, i)


def _kernel(p_ref, x_ref, tok_ref, lp_ref, *, nb: int, G: int):
    """One tile of 8 rows: ``p_ref`` [8, 128] (lanes 0-2: ``u``, ``1 / T``, greedy), ``x_ref`` [8, V]
    raw logits; writes the token (int32) and ``behav_logp`` (fp32) across the lanes of [8, 128]."""
    shape = (x_ref.shape[0], LANES)
    lane_i = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    lane = lane_i.astype(_F32)
    p = p_ref[...]
    u, inv_t, greedy = (_lane_at(p, lane, jnp.full((shape[0], 1), float(c), _F32)) for c in range(3))
    M, g_idx = _max_pass(x_ref, inv_t, lane, nb, G)
    gs = _mass_pass(x_ref, inv_t, M, lane, nb, G)
    cg = _lane_prefix(gs, lane)
    total = jnp.max(cg, axis=1, keepdims=True)  # the running sum's last value (non-decreasing)
    x = u * total
    grp = _first_above(cg, x, gs, lane)
    prev_g = _lane_at(cg, lane, grp - 1.0)
    kk, i, y_tok = _in_group(_select_pass(x_ref, grp, nb, G), inv_t, M, prev_g, x, lane)
    log_s = jnp.log(total)
    is_greedy = greedy > 0.5
    tok = jnp.where(is_greedy, g_idx, (grp * G + kk) * LANES + i)
    logp = jnp.where(is_greedy, M - M, y_tok - M) - log_s
    tok_ref[...] = jnp.broadcast_to(tok.astype(jnp.int32), shape)
    lp_ref[...] = jnp.broadcast_to(logp, shape)


@functools.partial(jax.jit, static_argnames=("interpret",))
def sample_untruncated(logits: jax.Array, u: jax.Array, inv_t: jax.Array, greedy: jax.Array, *,
                       interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """The untruncated draw of :func:`rollout.engine.sampler.sample_tokens` in one read of ``logits``.

    Args:
      logits: [B, V] float32 (V a multiple of 128 up to 196,608: :func:`kernel_fits`; ``-inf`` = no
        mass; every row needs a finite entry). B need not be a multiple of 8 (the last tile is partial).
      u: [B] float32 in [0, 1): the row's uniform (``sample_tokens`` draws it from the row's key).
      inv_t: [B] float32: ``1 / T`` as ``sample_tokens`` computes it (1 on greedy rows).
      greedy: [B] bool: take the first argmax (``temperature <= 0``).
      interpret: run in Pallas TPU interpret mode (tests on CPU).

    Returns:
      ``(tokens [B] int32, behav_logp [B] float32)``: the inverse-CDF draw of ``u`` in vocabulary order
      (the XLA path's token up to fp32 rounding at a CDF boundary) and ``(x / T - max) - log(sum exp)``.

    Raises:
      ValueError: V is not a multiple of 128 within :data:`TILE_VMEM_BUDGET` (:func:`kernel_fits`).
    """
    from jax.experimental import pallas as pl  # lazy: pallas only where the kernel runs
    from jax.experimental.pallas import tpu as pltpu

    B, V = logits.shape
    if not kernel_fits(V):
        raise ValueError(f"sample_untruncated: vocabulary {V} is outside the kernel's (a multiple of {LANES}, "
                         f"at most {TILE_VMEM_BUDGET // (8 * ROWS)}: kernel_fits)")
    nb = V // LANES
    R = ROWS if B >= ROWS else B
    params = jnp.stack([u.astype(_F32), inv_t.astype(_F32), greedy.astype(_F32)], axis=1)
    params = jnp.pad(params, ((0, 0), (0, LANES - 3)))
    row = lambda r: (r, 0)  # noqa: E731
    vmem = 2 * ROWS * V * 4 + (4 << 20)  # the double-buffered row tile and the kernel's temporaries (<= 16 MiB)
    tok, lp = pl.pallas_call(
        functools.partial(_kernel, nb=nb, G=_group_size(nb)),
        grid=(pl.cdiv(B, R),),
        in_specs=[pl.BlockSpec((R, LANES), row), pl.BlockSpec((R, V), row)],
        out_specs=[pl.BlockSpec((R, LANES), row), pl.BlockSpec((R, LANES), row)],
        out_shape=[jax.ShapeDtypeStruct((B, LANES), jnp.int32), jax.ShapeDtypeStruct((B, LANES), _F32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",), vmem_limit_bytes=vmem),
        interpret=interpret,
    )(params, logits.astype(_F32))
    return tok[:, 0], lp[:, 0]
