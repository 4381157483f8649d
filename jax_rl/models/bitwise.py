"""Batch-invariant pieces of the bitwise mode (``model.bitwise: true``): with them the rollout
engine's decode, its re-score by prefill and the learner's forward compute every token's log-prob with the same
bits, whatever other rows share the call.

What varies on XLA:CPU with the rows that share a call (``bench/bitwise_pieces.py``, jax 0.10.2): a matmul's
rows below 64 (a 1-row call takes the GEMV path; 2-32 rows of a 64 x 640 product differ too), a row
reduction's (the mean of RMSNorm, a log-softmax over the vocab) below 64 rows, and the attention's key
reduction (the bucket of keys a call gathers, 1 query against T). What holds: every tested per-row piece
gives the same bits for a row whatever its position among >= 64 rows. So the mode has two pieces:

- **one row tile** (:data:`ROW_TILE` = 64): every per-token op (projections, norms, RoPE, MLP / MoE, LM
  head, log-softmax) runs on the call's tokens flattened and padded to a multiple of 64 rows
  (:func:`to_rows` / :func:`from_rows`, materialised at each end (:func:`materialize`) so XLA cannot narrow the
  padded op back);
- **attention over fixed key chunks** (:func:`chunked_attend`): keys at absolute positions in chunks of
  :data:`KEY_CHUNK`, an online softmax combined chunk after chunk in position order, each chunk's scores
  and values computed for a query-row tile of 64 (:data:`QUERY_TILE`: the G query heads of a kv head times the
  tokens, padded). A chunk past a
  query's position changes nothing (a ``where`` leaves the row as it was; a chunk past every row of a block of
  query tiles is not computed at all, :data:`CAUSAL_SKIP`), so 1 query (decode) and T queries
  (prefill, the learner), any key bucket, any page layout give the same bits.

On XLA:CPU the mode's projections and LM head also contract in fixed chunks of :data:`K_CHUNK` (128)
(:func:`chunked_contract`, inside :func:`chunked_contractions`): Eigen splits a longer contraction by its thread
pool's size and the row count, which the row tile alone does not fix.

On a mesh (the learner's, an engine's ``rollout.mesh``) every contraction and row reduction still runs whole
on each device (:data:`WHOLE_ON_MESH`): each layer's weights are gathered (:func:`replicated`, at the layer's
start; the LM head's before its dot) and the row tile's activations keep their feature axes unsplit, the rows
split over the batch axes in whole tiles per device (:func:`row_groups`). Otherwise GSPMD may split a dot's
contraction (the weights are split on ``embed``) into partial dots and an all-reduce: another summation order.

The engine and the learner call the same code (the model, :func:`token_logprobs_rows`). Only forwards need the
bits: the learner's gradient uses ``custom_vjp`` backward rules (:data:`CUSTOM_BACKWARD`) that skip the transpose
of the chunk scan and of the ``materialize`` conds.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec as P

from jax_rl.models.backend_target import current_target_backend
from jax_rl.sharding import axis_names, logical_to_pspec

Array = jax.Array

__all__ = ["ROW_TILE", "QUERY_TILE", "KEY_CHUNK", "BITWISE_ATTENTION", "enabled", "CPU_COMPILER_OPTIONS",
           "compiler_options", "jit", "to_rows", "from_rows", "chunked_attend", "token_logprobs_rows",
           "row_tile_of", "rows_trunk", "materialize", "behav_logp", "CUSTOM_BACKWARD", "WHOLE_ON_MESH",
           "row_groups", "replicated", "K_CHUNK", "chunked_contractions", "k_chunks", "chunked_contract",
           "CAUSAL_SKIP", "SKIP_BLOCK"]

ROW_TILE = 64
"""Rows per tile of every per-token op in the mode (a call's tokens padded to a multiple of it), read at trace
time. 64 failed the gate until the mode set ``xla_cpu_experimental_ynn_fusion_type=""`` (fp32 tiny_dense: 8
comparisons differed, the first "seq 0: learner batch 0", a 1,024-row learner call; a 64-row prefill re-score
differed from a 256-row learner call in 1-16 tokens, 4.8e-7); with that option the whole gate holds at 64,
and a decode of up to 64 slots computes 64 rows instead of 256."""

QUERY_TILE = 64
"""Query rows (a kv head's G query heads times the call's tokens) per tile of :func:`chunked_attend`: 64 gives the
gate's bits (16 did not: a decode row alone differed from the learner in 25 of 65 tokens, fp32 tiny_dense)."""

KEY_CHUNK = 64
"""Keys per chunk of :func:`chunked_attend` (at absolute positions 0, 64, 128, ...)."""


CAUSAL_SKIP = True
"""Read at trace time. True: :func:`chunked_attend` runs, per block of :data:`SKIP_BLOCK` query tiles, only the key
chunks up to the last one a row of the block can see (a ``fori_loop`` with a traced trip count), so the learner's
and a prefill's causal T x T attention computes about half the chunks and a decode over a long bucket only the
chunks below its rows' positions. The chunks computed are the same :func:`_chunk_step` in the same order, and a
chunk skipped was one the ``where`` made an exact no-op, so the bits are the unskipped loop's
(``test_causal_skip_changes_no_bit``). False (or :data:`CUSTOM_BACKWARD` off: a traced trip count has no reverse
autodiff): one ``scan`` over every chunk of the keys."""

SKIP_BLOCK = 4
"""Query tiles (of :data:`QUERY_TILE` rows) per block of the causal skip (:data:`CAUSAL_SKIP`), read at trace time:
a block's trip count is set by its last row, so a smaller block skips more chunks at the cost of more, smaller
loop steps."""


CPU_COMPILER_OPTIONS = {"xla_cpu_use_fusion_emitters": False, "xla_cpu_experimental_ynn_fusion_type": "",
                        "xla_allow_excess_precision": False}
"""XLA:CPU options of every program of the mode. Measured (jax 0.10.2): with the default fusion emitters an
elementwise fusion (RoPE's ``x*cos + rot*sin`` after the q/k norm) gives other bits when a consumer's slice is
fused into it (the learner's padded rows: 65-68 of 6912 elements of one layer's keys differ); with the older
loop emitters it does not. With the default YNNPACK fusions a call of >= 1024 rows gives other bits than one of
<= 768 (the learner's forward of two sequences at 2 x 512 vs 2 x 56 positions: 4 and 6 tokens differ; a lone
dot, log-softmax and ``chunked_attend`` are invariant: the offload applies to fused ops at that size); with
``xla_cpu_experimental_ynn_fusion_type=""`` (none offloaded) they are equal
(``test_bitwise_row_count_above_768_equal``). With excess precision allowed (XLA's default) XLA may skip a bf16
rounding between ops where it sees fit, and the mesh-split learner's program (other fusions) did: in bf16 its
log-probs differed from the one-device engine's in every token (257 of 257, tiny_dense and tiny_moe, fsdp=8);
with ``xla_allow_excess_precision=False`` every bf16 op rounds as written and none differ. Set per program
(``jax.jit(compiler_options=...)``), so the fast mode's programs keep theirs."""


K_CHUNK = 128
"""Contraction length per chunk of the mode's projections on XLA:CPU (:func:`chunked_contract`), read at trace
time. XLA:CPU runs a dot through Eigen, whose contraction splits the reduction over k by the intra-op thread
pool's size and the row count (sharding by the inner dim, k blocks): with 8 host devices (the tests'; presumably
a larger pool on this 2-core host) a 64-row [64, 256] x [256, 128] dot gave other bits than the same rows among
192 or 1,024 (7,350 of 8,192 elements; [64, 512] x [512, 256]: 14,679), and than the same call under one device;
at k <= 128 every shape tried (64-1,024 rows, n 64-3,072) was invariant to both. So a longer contraction runs as
fixed chunks of 128 (a batched dot, fp32 partials) summed in chunk order. This was the engine-vs-learner gap at
hidden 128 / 256 (28 / 39 of 80 tokens): the engine's 64-row decode and prefill tiles against the learner's 192."""

_CHUNKED = contextvars.ContextVar("jax_rl_bitwise_chunked_contractions", default=False)


@contextlib.contextmanager
def chunked_contractions():
    """Within it (at trace time) the model's projections (:func:`jax_rl.models.qwen3.layers._proj`) and LM head
    contract in :data:`K_CHUNK` chunks on XLA:CPU (:func:`chunked_contract`): the mode's trunk
    (:func:`rows_trunk`) and LM head enter it; elsewhere (the fast mode, a TPU target) contractions are as written."""
    tok = _CHUNKED.set(current_target_backend() == "cpu")
    try:
        yield
    finally:
        _CHUNKED.reset(tok)


def k_chunks(k: int) -> int:
    """How many :data:`K_CHUNK` chunks a contraction of length ``k`` takes here: 1 (the dot as written) outside
    :func:`chunked_contractions` or for ``k <= K_CHUNK``."""
    return max(1, -(-int(k) // K_CHUNK)) if _CHUNKED.get() else 1


def chunked_contract(x: Array, w: Array, n_in: int = 1, *, w_k_last: bool = False, out_dtype=None) -> Array:
    """x's last ``n_in`` dims (K elements) against w's first ``n_in`` (``w_k_last``: its last ``n_in``, the tied
    LM head's [V, D]), in chunks of :data:`K_CHUNK` along K (zero-padded), each a dot with fp32 partials, summed
    in chunk order: [*lead, *out] in ``out_dtype`` (default x.dtype). Its bits do not depend on Eigen's threads."""
    K = math.prod(x.shape[x.ndim - n_in:])
    lead, out = x.shape[:x.ndim - n_in], (w.shape[:w.ndim - n_in] if w_k_last else w.shape[n_in:])
    c = max(1, -(-K // K_CHUNK))
    x2 = x.reshape(-1, K)
    w2 = w.reshape(-1, K) if w_k_last else w.reshape(K, -1)
    if c * K_CHUNK != K:
        x2 = jnp.pad(x2, ((0, 0), (0, c * K_CHUNK - K)))
        w2 = jnp.pad(w2, ((0, 0), (0, c * K_CHUNK - K)) if w_k_last else ((0, c * K_CHUNK - K), (0, 0)))
    x3 = x2.reshape(x2.shape[0], c, K_CHUNK)
    if w_k_last:
        parts = jnp.einsum("mck,ock->cmo", x3, w2.reshape(w2.shape[0], c, K_CHUNK), preferred_element_type=jnp.float32)
    else:
        parts = jnp.einsum("mck,cko->cmo", x3, w2.reshape(c, K_CHUNK, -1), preferred_element_type=jnp.float32)
    acc = parts[0]
    for i in range(1, c):  # chunk order, elementwise
        acc = acc + parts[i]
    return acc.astype(x.dtype if out_dtype is None else out_dtype).reshape(*lead, *out)


CUSTOM_BACKWARD = True
"""Read at trace time: the mode's pieces carry ``jax.custom_vjp`` backward rules (:func:`chunked_attend`: a dense
softmax-attention VJP recomputed from q, k, v instead of the transpose of the key-chunk scan; :func:`materialize`:
the identity instead of a transposed ``lax.cond``). The forward (every bit the gate compares, the primal of a
gradient program included) is the same code either way; the gradients are the attention's ordinary gradient, equal
to the autodiff of the chunk scan within fp32 rounding, not bit for bit
(``test_custom_backward_grads_match_autodiff``). False: autodiff through the forward code (what
``bench/bitwise_breakdown.py``'s ``autodiff`` variant times)."""


BITWISE_ATTENTION = "bitwise"
"""The ``Qwen3ForCausalLM(attention=...)`` kind that turns the mode on (``model_kwargs`` maps ``model.bitwise``
to it)."""


def enabled(model_kwargs) -> bool:
    """Whether ``Qwen3ForCausalLM`` keyword arguments (an engine's ``model_kwargs``) select the bitwise mode."""
    return dict(model_kwargs or {}).get("attention") == BITWISE_ATTENTION


def compiler_options(backend: str | None = None) -> dict:
    """The mode's compiler options for ``backend`` (default: the backend being compiled for,
    :func:`jax_rl.models.backend_target.current_target_backend`: a TPU topology's AOT compile gets none):
    XLA:CPU's :data:`CPU_COMPILER_OPTIONS`, none elsewhere."""
    return dict(CPU_COMPILER_OPTIONS) if (backend or current_target_backend()) == "cpu" else {}


def jit(fn, **kw):
    """``jax.jit`` with the mode's :func:`compiler_options` (what the engine's and the learner's programs use
    in the mode)."""
    return jax.jit(fn, compiler_options=compiler_options(), **kw)


def materialize(x):
    """``x`` (an array or a pytree of them) unchanged, computed whole before any consumer reads it: the value
    passes through a ``lax.cond`` on a runtime predicate, so XLA cannot fuse a consumer (the slice that drops
    the padding rows, a transpose) into its producer's loop, whose code then depends on the consumer's shape
    (XLA:CPU removes ``optimization_barrier`` before fusion). The predicate is "the first element is not NaN";
    when it is NaN the other branch fills every floating leaf with NaN: the call's output is non-finite as a
    whole (the engine and the learner count and mask non-finite log-probs), never a silently changed value.
    Its gradient is the identity (:data:`CUSTOM_BACKWARD`: a ``custom_vjp`` passing the cotangent through, no
    ``lax.cond`` in the backward; the boundary only fixes the forward's bits)."""
    leaves = jax.tree.leaves(x)
    if not any(jnp.issubdtype(a.dtype, jnp.floating) for a in leaves):
        return x
    return _materialize_vjp(x) if CUSTOM_BACKWARD else _materialize(x)


def _materialize(x):
    first = next(a for a in jax.tree.leaves(x) if jnp.issubdtype(a.dtype, jnp.floating))
    pred = ~jnp.isnan(first.reshape(-1)[0])

    def poisoned(t):
        return jax.tree.map(lambda a: jnp.full_like(a, jnp.nan) if jnp.issubdtype(a.dtype, jnp.floating) else a, t)

    return jax.lax.cond(pred, lambda t: t, poisoned, x)


@jax.custom_vjp
def _materialize_vjp(x):
    return _materialize(x)


def _materialize_fwd(x):
    return _materialize(x), None


def _materialize_bwd(_, ct):
    return (ct,)


_materialize_vjp.defvjp(_materialize_fwd, _materialize_bwd)


WHOLE_ON_MESH = True
"""Read at trace time. True: under a mesh the mode gathers every layer's weights (:func:`replicated`) and lays the
row tile out per batch shard (:func:`row_groups`), so no contraction or row reduction is split over devices. False
(the gate's negative control): GSPMD's own choice. Measured (fsdp=8 over 8 CPU devices, tiny_dense fp32, a learner
batch of 8 x 30 positions: 240 rows padded to 256, the padding breaking the rows' batch split): the learner's
log-probs differed from the one-device engine's in 26 of 80 tokens (1 ULP; the q/k/v, MLP and LM-head dots
over 1/8 of ``embed`` each, all-reduced, and RMSNorm's sum of squares likewise); with it, none differ."""


def _auto_mesh():
    """The ambient ``jax.set_mesh`` mesh when it has an axis > 1 and only Auto axes (None otherwise, or when
    :data:`WHOLE_ON_MESH` is off)."""
    if not WHOLE_ON_MESH:
        return None
    m = jax.sharding.get_abstract_mesh()
    if m is None or m.empty or any(t != AxisType.Auto for t in m.axis_types) or math.prod(m.axis_sizes) == 1:
        return None
    return m


def row_groups(batch: int) -> tuple[int, tuple[str, ...]]:
    """(G, axes): the mesh axes that split a batch of ``batch`` rows (the rules' ``activation_batch``: ``data``,
    ``fsdp``, ``expert``, those that divide it) and the product G of their sizes; (1, ()) without a mesh. The row
    tile is then laid out as G groups of ``batch / G`` rows each, every group padded to whole tiles, one group per
    batch shard: each device's ops run on whole tiles of its own rows."""
    m = _auto_mesh()
    if m is None:
        return 1, ()
    axes = axis_names(logical_to_pspec(("activation_batch",), shape=(batch,), mesh=m)[0])
    sizes = dict(zip(m.axis_names, m.axis_sizes))
    return math.prod(sizes[a] for a in axes), axes


def replicated(tree):
    """``tree`` (an array, or a pytree of them: a layer's params) constrained to whole copies on every device of
    the ambient mesh (``with_sharding_constraint`` to ``P()``: an all-gather per use, ZeRO-3 style); unchanged
    without a mesh or with :data:`WHOLE_ON_MESH` off."""
    if _auto_mesh() is None:
        return tree
    return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, P()), tree)


def row_tile_of(n: int, tile: int | None = None) -> int:
    """``n`` rounded up to a multiple of ``tile`` (default :data:`ROW_TILE`, read at trace time; at least one
    tile)."""
    tile = ROW_TILE if tile is None else int(tile)
    return max(1, -(-int(n) // tile)) * tile


def to_rows(x: Array, lead: int, tile: int | None = None) -> Array:
    """x [*lead_dims, ...] (``lead`` leading dims, e.g. 2 for [B, T, ...]) -> [G, R, ...]: the lead dims
    flattened and padded with zeros to R, a multiple of ``tile``; materialised (:func:`materialize`). G = 1
    without a mesh; under one, G batch shards (:func:`row_groups` of B = ``x.shape[0]``): group g holds batch
    rows ``[g B/G, (g+1) B/G)`` flattened and padded, split over the batch axes, every other dim whole.
    (Padding each row's T instead, with the weights left split, was measured worse: the engine's re-score and
    decode then differed from the learner in 17 of 80 tokens.)"""
    G, axes = row_groups(x.shape[0])
    n = math.prod(x.shape[:lead]) // G
    if G == 1:  # one group: the layout (and program) of a one-device call
        flat = x.reshape(n, *x.shape[lead:])
        rows = jnp.pad(flat, ((0, row_tile_of(n, tile) - n),) + ((0, 0),) * (flat.ndim - 1))[None]
        # on a mesh that does not split this batch (tensor only; B not divisible), every device takes all the rows
        return materialize(rows if _auto_mesh() is None else jax.lax.with_sharding_constraint(rows, P()))
    flat = x.reshape(G, n, *x.shape[lead:])
    rows = jnp.pad(flat, ((0, 0), (0, row_tile_of(n, tile) - n)) + ((0, 0),) * (flat.ndim - 2))
    return materialize(jax.lax.with_sharding_constraint(rows, P(axes, *([None] * (rows.ndim - 1)))))


def from_rows(y: Array, lead_shape: tuple[int, ...]) -> Array:
    """Inverse of :func:`to_rows`: [G, R, ...] -> [*lead_shape, ...] (the padding rows dropped)."""
    G = y.shape[0]
    n = math.prod(lead_shape) // G
    y = materialize(y)
    return (y[0, :n] if G == 1 else y[:, :n]).reshape(*lead_shape, *y.shape[2:])


def _chunk_step(carry, xs, qh, qpos, scale):
    m, l, o = carry
    kc, vc, kpos = xs  # [B,C,K,H] x2, [C]
    s = jnp.einsum("bkmh,bckh->bkmc", qh, kc, preferred_element_type=jnp.float32) * scale
    ok = kpos[None, None, :] <= qpos[:, :, None]  # [B,M,C]
    s = jnp.where(ok[:, None], s, -jnp.inf)
    any_ok = jnp.any(ok, axis=-1)[:, None]  # [B,1,M]
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_safe = jnp.where(any_ok, m_new, 0.0)
    alpha = jnp.exp(m - m_safe)
    p = jnp.exp(s - m_safe[..., None])
    l_new = l * alpha + jnp.sum(p, axis=-1)
    pv = jnp.einsum("bkmc,bckh->bkmh", p.astype(vc.dtype), vc, preferred_element_type=jnp.float32)
    o_new = o * alpha[..., None] + pv
    # a chunk with no key a row may see leaves that row as it was (bit for bit)
    return (jnp.where(any_ok, m_new, m), jnp.where(any_ok, l_new, l),
            jnp.where(any_ok[..., None], o_new, o)), None


def chunked_attend(q: Array, k: Array, v: Array, q_pos: Array, *, chunk: int | None = None,
                   q_tile: int | None = None) -> Array:
    """Causal GQA attention, batch-invariant: keys in fixed chunks of ``chunk`` absolute positions,
    an online softmax combined in position order, scores and values per query-row tile of ``q_tile``.

    q [B,T,N,H]; k/v [B,S,K,H] with key s at absolute position s (a contiguous cache row, a gathered
    page window, or the learner's own T keys); q_pos [B,T] int: each query's position (it sees keys
    ``s <= q_pos``; a negative position sees none and gives zeros). Returns [B,T,N,H] in q.dtype. Scores are
    ``q.k * H**-0.5`` in fp32, the softmax fp32, values accumulated in fp32. Raises ValueError for
    N % K != 0. The gradient (:data:`CUSTOM_BACKWARD`) is the VJP of the same attention as one dense masked
    softmax in fp32 (:func:`_dense_attend`), recomputed from q, k, v: the ordinary attention gradient, not the
    transpose of the chunk scan (the forward's bits are the scan's either way).
    """
    N, K = q.shape[2], k.shape[2]
    if N % K:
        raise ValueError(f"num heads {N} is not a multiple of kv heads {K}")
    chunk = KEY_CHUNK if chunk is None else int(chunk)  # read at trace time (the gate's perturbed control)
    q_tile = QUERY_TILE if q_tile is None else int(q_tile)
    q_pos = jnp.asarray(q_pos, jnp.int32)
    if CUSTOM_BACKWARD:
        return _attend_vjp(q, k, v, q_pos, chunk, q_tile)
    return _chunk_scan(q, k, v, q_pos, chunk, q_tile)


def _chunk_scan(q: Array, k: Array, v: Array, q_pos: Array, chunk: int, q_tile: int) -> Array:
    """:func:`chunked_attend`'s forward (the bits of the mode)."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    nc = max(1, -(-S // chunk))
    if nc * chunk != S:
        pad = ((0, 0), (0, nc * chunk - S), (0, 0), (0, 0))
        k, v = jnp.pad(k, pad), jnp.pad(v, pad)
    M = T * G
    Mp = row_tile_of(M, q_tile)
    qh = q.reshape(B, T, K, G, H).transpose(0, 2, 1, 3, 4).reshape(B, K, M, H)  # rows (t, g)
    qpos = jnp.repeat(q_pos, G, axis=1)  # [B, M]
    if Mp != M:
        qh = jnp.pad(qh, ((0, 0), (0, 0), (0, Mp - M), (0, 0)))
        qpos = jnp.pad(qpos, ((0, 0), (0, Mp - M)), constant_values=-1)
    # the query rows materialised (what XLA fuses into the dots' operands must not depend on the caller's
    # graph); each chunk's keys and values sliced from k / v in place (no transposed copy of the cache)
    qh = materialize(qh)
    init = (jnp.full((B, K, Mp), -jnp.inf, jnp.float32), jnp.zeros((B, K, Mp), jnp.float32),
            jnp.zeros((B, K, Mp, H), jnp.float32))

    def step(c, i):
        kc, vc = (jax.lax.dynamic_slice_in_dim(a, i * chunk, chunk, axis=1).astype(q.dtype) for a in (k, v))
        return _chunk_step(c, (kc, vc, i * chunk + jnp.arange(chunk, dtype=jnp.int32)), qh, qpos, H ** -0.5)

    if CAUSAL_SKIP and CUSTOM_BACKWARD:
        l, o = _skip_scan(qh, qpos, k, v, nc, chunk, q_tile, q.dtype)
    else:
        (_, l, o), _ = jax.lax.scan(step, init, jnp.arange(nc, dtype=jnp.int32))
    o = o / jnp.where(l > 0, l, 1.0)[..., None]
    o = materialize(o)[:, :, :M].reshape(B, K, T, G, H).transpose(0, 2, 1, 3, 4).reshape(B, T, N, H)
    return o.astype(q.dtype)


def _skip_scan(qh: Array, qpos: Array, k: Array, v: Array, nc: int, chunk: int, q_tile: int, dtype):
    """:func:`_chunk_scan`'s chunk loop with the causal skip (:data:`CAUSAL_SKIP`): the query rows qh [B,K,Mp,H]
    (positions qpos [B,Mp]) in blocks of :data:`SKIP_BLOCK` tiles, one after the other; each block runs the chunks
    0 .. max(block's positions) // chunk (a ``fori_loop`` with that traced trip count, at most ``nc``), the same
    :func:`_chunk_step` in the same order. The chunks it leaves out are past every position of the block, where
    the unskipped loop's ``where`` left every row as it was. Returns (l [B,K,Mp], o [B,K,Mp,H]) fp32."""
    B, K, Mp, H = qh.shape
    blk = min(Mp, SKIP_BLOCK * q_tile)
    nb = -(-Mp // blk)
    if nb * blk != Mp:  # padding rows at position -1 (they see no key; dropped below)
        qh = jnp.pad(qh, ((0, 0), (0, 0), (0, nb * blk - Mp), (0, 0)))
        qpos = jnp.pad(qpos, ((0, 0), (0, nb * blk - Mp)), constant_values=-1)
    qb = qh.reshape(B, K, nb, blk, H).transpose(2, 0, 1, 3, 4)  # [nb, B, K, blk, H]
    pb = qpos.reshape(B, nb, blk).transpose(1, 0, 2)  # [nb, B, blk]

    def block(xs):
        qt, pt = xs
        n = jnp.clip(jnp.max(pt) // chunk + 1, 0, nc)  # chunks 0..n-1: the last one a row of the block sees

        def body(i, c):
            kc, vc = (jax.lax.dynamic_slice_in_dim(a, i * chunk, chunk, axis=1).astype(dtype) for a in (k, v))
            return _chunk_step(c, (kc, vc, i * chunk + jnp.arange(chunk, dtype=jnp.int32)), qt, pt, H ** -0.5)[0]

        init = (jnp.full((B, K, blk), -jnp.inf, jnp.float32), jnp.zeros((B, K, blk), jnp.float32),
                jnp.zeros((B, K, blk, H), jnp.float32))
        _, l, o = jax.lax.fori_loop(0, n, body, init)
        return l, o

    l, o = jax.lax.map(block, (qb, pb))  # [nb, B, K, blk], [nb, B, K, blk, H]
    l = l.transpose(1, 2, 0, 3).reshape(B, K, nb * blk)[:, :, :Mp]
    o = o.transpose(1, 2, 0, 3, 4).reshape(B, K, nb * blk, H)[:, :, :Mp]
    return l, o


def _dense_attend(q: Array, k: Array, v: Array, q_pos: Array) -> Array:
    """The attention of :func:`chunked_attend` as one masked softmax over all S keys, fp32 in and out (q
    [B,T,N,H], k/v [B,S,K,H], q_pos [B,T]): the function whose VJP is the mode's attention gradient. A query
    that sees no key gives zeros (and zero gradients)."""
    B, T, N, H = q.shape
    K = k.shape[2]
    qh = q.reshape(B, T, K, N // K, H)
    s = jnp.einsum("btkgh,bskh->bkgts", qh, k) * H ** -0.5
    ok = (jnp.arange(k.shape[1], dtype=jnp.int32)[None, None, :] <= q_pos[:, :, None])[:, None, None]  # [B,1,1,T,S]
    p = jax.nn.softmax(jnp.where(ok, s, jnp.finfo(jnp.float32).min), axis=-1)
    o = jnp.einsum("bkgts,bskh->btkgh", jnp.where(ok, p, 0.0), v)
    return o.reshape(B, T, N, H)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attend_vjp(q, k, v, q_pos, chunk, q_tile):
    return _chunk_scan(q, k, v, q_pos, chunk, q_tile)


def _attend_fwd(q, k, v, q_pos, chunk, q_tile):
    return _chunk_scan(q, k, v, q_pos, chunk, q_tile), (q, k, v, q_pos)


def _attend_bwd(chunk, q_tile, res, g):
    del chunk, q_tile
    q, k, v, q_pos = res
    _, vjp = jax.vjp(lambda q_, k_, v_: _dense_attend(q_, k_, v_, q_pos),
                     *(a.astype(jnp.float32) for a in (q, k, v)))
    dq, dk, dv = vjp(g.astype(jnp.float32))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_attend_vjp.defvjp(_attend_fwd, _attend_bwd)


def token_logprobs_rows(logits: Array, targets: Array, temperature=1.0) -> Array:
    """``log_softmax(logits / temperature)[targets]`` on the row tile: logits [..., V] (any float dtype),
    targets [...] int -> [...] float32, every row computed among a multiple of :data:`ROW_TILE` rows (the
    engine's behaviour log-prob and the learner's log-prob in the mode are this function)."""
    lead = logits.shape[:-1]
    lr = to_rows(logits.astype(jnp.float32), len(lead))
    tr = to_rows(jnp.asarray(targets, jnp.int32), len(lead))
    t = jnp.asarray(temperature, jnp.float32)
    if t.ndim:  # per-row temperatures; the padding rows get 1 (no division by zero)
        t = to_rows(jnp.broadcast_to(t, lead) - 1.0, len(lead)) + 1.0
    lg = lr / (t[..., None] if t.ndim else t)
    lp = jax.nn.log_softmax(lg, axis=-1)
    return from_rows(jnp.take_along_axis(lp, tr[..., None], axis=-1)[..., 0], lead)


def _unrow_layers(a: Array | None, lead: tuple[int, int]) -> Array | None:
    """Per-layer tiles [n, *tile, ...] -> [n, B, T, ...]."""
    return None if a is None else jax.vmap(lambda x: from_rows(x, lead))(a)


def rows_trunk(trunk_body, x: Array, positions: Array, attend, layer_xs, forced_expert_ids,
               output_hidden_states: bool, **kw):
    """The decoder stack on the row tile: ``trunk_body`` (the model's ``_trunk_body``, same arguments) runs on
    x [B,T,D] flattened to [1, R, D] (R a multiple of :data:`ROW_TILE`), so every per-token op sees
    R rows; ``attend`` gets its q/k/v back as [B,T,...] (its keys, caches and pages are the caller's) and
    its output goes back onto the rows. Returns the body's ``TrunkOutput`` with h, expert ids, hidden
    states and per-token drops as [B,T,...] again (ys and carry are the attend's own)."""
    B, T = x.shape[:2]
    lead = (B, T)

    def wrapped(q, k, v, xs, *c):
        res = attend(*(from_rows(a, lead) for a in (q, k, v)), xs, *c)
        return (to_rows(res[0], 2),) + tuple(res[1:])

    forced = forced_expert_ids
    if forced is not None:
        if isinstance(forced, (list, tuple)):
            forced = [to_rows(jnp.broadcast_to(jnp.asarray(f), (B, T, jnp.shape(f)[-1])), 2) for f in forced]
        else:
            forced = jax.vmap(lambda f: to_rows(f, 2))(jnp.asarray(forced))
    valid = kw.pop("valid", None)  # kw: the body's remat, carry, valid, row_drops
    vr = None if valid is None else to_rows(jnp.broadcast_to(jnp.asarray(valid, bool), lead), 2)
    with chunked_contractions():
        t = trunk_body(to_rows(x, 2), to_rows(jnp.broadcast_to(positions, lead), 2), wrapped, layer_xs, forced,
                       output_hidden_states, valid=vr, **kw)
    dropped = t.dropped
    if dropped is not None and kw.get("row_drops"):
        dropped = _unrow_layers(dropped, lead)
    return t.replace(h=from_rows(t.h, lead), expert_ids=tuple(from_rows(i, lead) for i in t.expert_ids),
                     hidden_states=None if t.hidden_states is None else tuple(from_rows(h, lead)
                                                                             for h in t.hidden_states),
                     dropped=dropped)


def behav_logp(model, logits: Array, tokens: Array, temperature: Array, logp: Array) -> Array:
    """The engine's behaviour log-prob of sampled ``tokens`` [B] from ``logits`` [B, V] at per-row ``temperature``
    [B]: the sampler's own ``logp`` [B] in the fast mode; with ``model.bitwise`` the learner's function
    (:func:`token_logprobs_rows`) wherever the row samples (temperature > 0; a greedy row keeps the sampler's)."""
    if not getattr(model, "bitwise", False):
        return logp
    t = jnp.asarray(temperature, jnp.float32)
    return jnp.where(t > 0, token_logprobs_rows(logits, tokens, jnp.where(t > 0, t, 1.0)), logp)
