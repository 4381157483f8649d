"""The CPU paged prefill's causal block skip (issue 61 item 6, :func:`jax_rl.models.xla_attention.attend_offsets`):
it equals ``attend`` up to fp32 summation order, its skip changes no bit of a valid query's output, and a
query block never reads a key block above its causal frontier (NaN K/V there stay out of its output; the
unskipped [T, S] attention before the skip read them and gave NaN)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_rl.models import paged_attention as pa
from jax_rl.models import xla_attention as xa

TOL = 1e-5  # fp32: the blocked online softmax sums in another order than attend's one softmax


def _qkv(rng, B, T, S, N, K, H, dtype=jnp.float32):
    return tuple(jnp.asarray(rng.standard_normal(s), dtype) for s in ((B, T, N, H), (B, S, K, H), (B, S, K, H)))


def _causal_mask(starts, T, S):
    pos = starts[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
    return jnp.arange(S, dtype=jnp.int32)[None, None, :] <= pos[:, :, None]


# rows at different offsets, some padded; T not a multiple of the query block, S not of the key block (the
# clamped last key block)
CASE = dict(starts=[0, 13, 30, 0], lengths=[11, 5, 7, 0], T=11, S=45)


@pytest.mark.parametrize("q_block,k_block", [(4, 8), (3, 16), (64, 64)])
def test_attend_offsets_equals_attend_on_valid_queries(q_block, k_block):
    rng = np.random.default_rng(0)
    starts, lengths = jnp.array(CASE["starts"], jnp.int32), jnp.array(CASE["lengths"], jnp.int32)
    q, k, v = _qkv(rng, 4, CASE["T"], CASE["S"], 4, 2, 8)
    ref = xa.attend(q, k, v, _causal_mask(starts, CASE["T"], CASE["S"]))
    got = jax.jit(lambda *a: xa.attend_offsets(*a, q_block=q_block, k_block=k_block))(q, k, v, starts, lengths)
    valid = np.asarray(jnp.arange(CASE["T"])[None] < lengths[:, None])
    assert np.all(np.isfinite(np.asarray(got)))  # padded queries too (0 where their block is skipped)
    chex.assert_trees_all_close(np.asarray(got)[valid], np.asarray(ref)[valid], atol=TOL, rtol=TOL)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_skip_changes_no_bit_of_a_valid_query(dtype):
    """Skipped key blocks add exact zeros to the online softmax: the skip equals running every block."""
    rng = np.random.default_rng(1)
    starts, lengths = jnp.array(CASE["starts"], jnp.int32), jnp.array(CASE["lengths"], jnp.int32)
    q, k, v = _qkv(rng, 4, CASE["T"], CASE["S"], 4, 2, 8, dtype)
    run = jax.jit(lambda skip, *a: xa.attend_offsets(*a, q_block=4, k_block=8, skip=skip), static_argnums=0)
    valid = np.asarray(jnp.arange(CASE["T"])[None] < lengths[:, None])
    np.testing.assert_array_equal(np.asarray(run(True, q, k, v, starts, lengths))[valid],
                                  np.asarray(run(False, q, k, v, starts, lengths))[valid])


def _poisoned_pool(rng, S, frontier, ps=16, K=1, H=8):
    """One row's pool of S positions (page table 0..S/ps-1) with finite K/V below ``frontier`` and NaN K/V
    from it on, and the same pool all finite."""
    P = S // ps
    k = rng.standard_normal((1, S, K, H)).astype(np.float32)
    v = rng.standard_normal((1, S, K, H)).astype(np.float32)
    table = jnp.arange(P, dtype=jnp.int32)[None]
    pos = jnp.arange(S, dtype=jnp.int32)[None]
    pool = jnp.zeros((P, ps, 2 * K, H), jnp.float32)
    clean = pa.write_kv(pool, table, pos, jnp.asarray(k), jnp.asarray(v), jnp.ones((1, S), bool))
    k[:, frontier:], v[:, frontier:] = np.nan, np.nan
    return pa.write_kv(pool, table, pos, jnp.asarray(k), jnp.asarray(v), jnp.ones((1, S), bool)), clean, table


# (start, length, T, S, query rows checked): the upper triangle of a fresh prefill (query block 0 of a
# 512-position prompt needs key block 0 only), and a chunk at an offset in a larger page bucket (keys past
# the chunk's end: the bucket's padding)
FRONTIERS = [(0, 512, 512, 512, slice(0, xa.Q_BLOCK)), (300, 100, 128, 1024, slice(0, 100))]


@pytest.mark.parametrize("start,length,T,S,rows", FRONTIERS)
def test_the_cpu_paged_prefill_reads_no_key_block_above_the_frontier(start, length, T, S, rows):
    """Through the CPU paged path (``paged_attention_local``, backend ``cpu``) at the default block sizes:
    the key blocks from the checked queries' frontier (rounded up to a key block) hold NaN, their outputs
    stay finite and equal the clean pool's. Without the skip every query reads all S keys (0 * NaN)."""
    rng = np.random.default_rng(2)
    need = start + rows.stop  # the last checked query's position + 1
    frontier = -(-need // xa.K_BLOCK) * xa.K_BLOCK
    assert frontier < S  # a block to skip
    pool, clean, table = _poisoned_pool(rng, S, frontier)
    q = jnp.asarray(rng.standard_normal((1, T, 2, 8)), jnp.float32)
    starts, lengths = jnp.array([start], jnp.int32), jnp.array([length], jnp.int32)
    run = jax.jit(lambda pool: pa.paged_attention_local(q, pool, table, starts, lengths, S // 16, backend="cpu"))
    got, ref = np.asarray(run(pool))[0, rows], np.asarray(run(clean))[0, rows]
    assert np.all(np.isfinite(got)), f"{np.sum(~np.isfinite(got))} outputs read a skipped key block"
    np.testing.assert_array_equal(got, ref)


def test_query_blocks_past_every_rows_length_are_skipped():
    """Two rows of 100 and 200 valid queries in a 512-query program: keys from 256 on (NaN) are never read,
    the valid outputs are finite (a query block past both lengths is not computed at all)."""
    rng = np.random.default_rng(3)
    pool, clean, table = _poisoned_pool(rng, 512, 256)
    table = jnp.concatenate([table, table])
    q = jnp.asarray(rng.standard_normal((2, 512, 2, 8)), jnp.float32)
    starts, lengths = jnp.zeros(2, jnp.int32), jnp.array([100, 200], jnp.int32)
    run = jax.jit(lambda pool: pa.paged_attention_local(q, pool, table, starts, lengths, 32, backend="cpu"))
    got, ref = np.asarray(run(pool)), np.asarray(run(clean))
    for b, n in enumerate((100, 200)):
        assert np.all(np.isfinite(got[b, :n]))
        np.testing.assert_array_equal(got[b, :n], ref[b, :n])
