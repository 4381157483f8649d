"""Paged K/V (jax_rl.models.paged_attention, jax_rl.models.qwen3.paged): the write through a page
table, attention over live pages against the contiguous cache's attention (fp32, 1e-5), the TPU
ragged paged attention kernel's packing against the kernel's own reference, its Pallas interpret
mode on the CPU, its compile for a TPU topology, and the model's paged decode / append-prefill
against ``decode_step`` / ``extend`` / ``prefill``."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jax_rl.models import paged_attention as pa
from jax_rl.models.qwen3.layers import attend, attend_cached

TOL = 1e-5


def _pool_and_contiguous(rng, B, K, H, ps, M, P, S):
    """A random pool, a random page table (distinct pages, -1 past each row's pages) and the same
    K/V as a contiguous [B,S,K,H] cache, written through ``write_kv``."""
    k = jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, S, K, H)), jnp.float32)
    table = jnp.asarray(rng.permutation(P)[:B * M].reshape(B, M), jnp.int32)
    pool = jnp.asarray(rng.standard_normal((P, ps, 2 * K, H)), jnp.float32)  # garbage elsewhere
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    pool = pa.write_kv(pool, table, pos, k, v, jnp.ones((B, S), bool))
    return pool, table, k, v


def test_write_kv_places_entries_through_the_table_and_drops_invalid_ones():
    rng = np.random.default_rng(0)
    B, K, H, ps, M, P = 2, 2, 8, 4, 3, 8
    pool, table, k, v = _pool_and_contiguous(rng, B, K, H, ps, M, P, S=ps * M)
    gk, gv = pa.gather_contiguous(pool, table, M)
    np.testing.assert_array_equal(gk, k)
    np.testing.assert_array_equal(gv, v)
    # an invalid token, a -1 page and a position past the table write nothing
    t2 = table.at[1, 2].set(-1)
    new = jnp.full((B, 3, K, H), 7.0)
    pos = jnp.array([[0, 1, ps * M], [ps * 2, 1, 2]], jnp.int32)
    valid = jnp.array([[True, False, True], [True, True, True]])
    out = pa.write_kv(pool, t2, pos, new, new, valid)
    changed = np.argwhere(np.any(np.asarray(out != pool), axis=(2, 3)))
    assert sorted(map(tuple, changed)) == sorted([(int(table[0, 0]), 0), (int(table[1, 0]), 1),
                                                 (int(table[1, 0]), 2)])


@pytest.mark.parametrize("num_pages", [None, 4])
def test_decode_attention_equals_attend_cached(num_pages):
    rng = np.random.default_rng(1)
    B, N, K, H, ps, M, P = 3, 4, 2, 8, 4, 6, 24
    S = ps * M
    pool, table, k, v = _pool_and_contiguous(rng, B, K, H, ps, M, P, S)
    q = jnp.asarray(rng.standard_normal((B, 1, N, H)), jnp.float32)
    pos = jnp.array([5, 0, 15], jnp.int32)  # the decode token's position (its K/V already written)
    mask = (jnp.arange(S)[None, :] <= pos[:, None])[:, None, :]
    ref = attend_cached(q, k.swapaxes(1, 2), v.swapaxes(1, 2), mask)
    got = pa.paged_attention_xla(q, pool, table, pos, jnp.ones(B, jnp.int32), num_pages)
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=TOL)
    # a bucket too small for the longest row reads less and differs: the test can fail
    short = pa.paged_attention_xla(q, pool, table, pos, jnp.ones(B, jnp.int32), 2)
    assert not np.allclose(short[2], ref[2], atol=TOL)


def test_append_prefill_attention_equals_contiguous_at_given_starts():
    rng = np.random.default_rng(2)
    B, T, N, K, H, ps, M, P = 3, 5, 4, 2, 8, 4, 6, 20
    S = ps * M
    pool, table, k, v = _pool_and_contiguous(rng, B, K, H, ps, M, P, S)
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
    starts = jnp.array([3, 0, 17], jnp.int32)
    lengths = jnp.array([5, 2, 4], jnp.int32)
    qpos = starts[:, None] + jnp.arange(T)[None]
    mask = jnp.arange(S)[None, None, :] <= qpos[:, :, None]
    ref = attend(q, k, v, mask)
    got = pa.paged_attention_xla(q, pool, table, starts, lengths, pa.page_bucket(6, M))
    valid = np.asarray(jnp.arange(T)[None] < lengths[:, None])
    np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(ref)[valid], atol=TOL, rtol=TOL)


def test_page_bucket_and_pages_for():
    assert [pa.page_bucket(n, 8) for n in (0, 1, 2, 3, 5, 8, 9)] == [1, 1, 2, 4, 8, 8, 8]
    assert [pa.pages_for(n, 16) for n in (0, 1, 16, 17)] == [0, 1, 1, 2]


def _kernel_case(rng, T):
    B, N, K, H, ps, M, P = 3, 4, 2, 128, 4, 5, 20  # the kernel tiles head_dim by 128 lanes
    pool = jnp.asarray(rng.standard_normal((P, ps, 2 * K, H)), jnp.float32)
    table = jnp.asarray(rng.permutation(P)[:B * M].reshape(B, M), jnp.int32)
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
    starts = jnp.array([6, 0, 13], jnp.int32)
    lengths = jnp.array([T, min(T, 2), 1], jnp.int32)
    valid = np.asarray(jnp.arange(T)[None] < lengths[:, None])
    return q, pool, table, starts, lengths, valid


@pytest.mark.parametrize("T", [1, 4])
def test_kernel_packing_equals_xla_through_the_kernels_reference(T):
    """The wrapper's ragged packing (cu_q_lens, kv_lens, combined heads) around JAX's own
    reference of the kernel equals the XLA path: decode (T=1) and append-prefill (T=4)."""
    q, pool, table, starts, lengths, valid = _kernel_case(np.random.default_rng(3), T)
    ref = pa.paged_attention_xla(q, pool, table, starts, lengths)
    got = pa.paged_attention_kernel_ref(q, pool, table, starts, lengths)
    np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(ref)[valid], atol=TOL, rtol=TOL)
    assert np.all(np.asarray(got)[~valid] == 0)


@pytest.fixture
def interpreter_reads_reshaped_refs(monkeypatch):
    """Test-only shim for jax 0.10.2's Pallas TPU interpreter, which cannot read a reshaped ref
    (the kernel's ``cur_async_copy_kv.wait().reshape(...)`` of its VMEM K/V buffer):
    ``jax/_src/pallas/mosaic/interpret/interpret_pallas_call.py:get`` turns a load's transforms
    into one index range with ``interpret/utils.py:to_range``, which assumes every transform is
    an ``NDIndexer`` (``AttributeError: 'ReshapeTransform' object has no attribute 'indices'``).
    Within the test ``get`` reads through the transforms before the first reshape as before, then
    applies the reshape and the index ranges after it to the array it read (what
    ``state.discharge.transform_array`` does for a ``ReshapeTransform``). Applied only while
    ``to_range`` has the gap, so on a jax that reads reshaped refs the test runs the stock
    interpreter; restored after the test (monkeypatch)."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    from jax._src.pallas.mosaic.interpret import utils as iu
    from jax._src.state.types import ReshapeTransform

    try:
        iu.to_range((ReshapeTransform((1,)),))
        return  # the interpreter handles it: nothing to patch
    except AttributeError:
        pass
    raw_get = ipc.get.__wrapped__  # below ``fail_on_exception``; the DMA engine calls it too

    def get(token, device_id, local_core_id, memory_space, buffer_id, transforms, *args, **kwargs):
        cut = next((i for i, t in enumerate(transforms) if isinstance(t, ReshapeTransform)), None)
        if cut is None:
            return raw_get(token, device_id, local_core_id, memory_space, buffer_id, transforms, *args, **kwargs)
        token, val = raw_get(token, device_id, local_core_id, memory_space, buffer_id, transforms[:cut],
                             *args, **kwargs)
        for t in jax.tree.map(int, tuple(transforms[cut:])):
            if isinstance(t, ReshapeTransform):
                val = val.reshape(t.shape)
                continue
            rng = iu.to_range((t,))  # an NDIndexer (anything else raises here, as in stock get)
            if iu.is_range_out_of_bounds_for_shape(rng, val.shape):
                raise IndexError(f"out-of-bounds read {rng} of a reshaped ref of shape {val.shape}")
            val = val[rng]
        return token, val

    monkeypatch.setattr(ipc, "get", ipc.fail_on_exception(get))


@pytest.mark.parametrize("T", [1, 4])
def test_kernel_in_pallas_tpu_interpret_mode_on_cpu(T, interpreter_reads_reshaped_refs):
    """The kernel itself (DMAs of pages through the page table, double buffering, ragged query
    blocks, online softmax), in Pallas TPU interpret mode on the CPU, against the XLA path to
    1e-5 in fp32: decode (T=1) and append-prefill (T=4); rows hold 1-4 of 5 pages, so the
    2-page KV blocks include a partial one, and the 2-token query blocks cross rows.
    ``num_queries_per_block <= N // K``: jax 0.10.2's ``shared_memory.swap_buffer_content`` builds
    a masked store's in-bounds mask along axis 0 for every axis, so the kernel's masked store
    into ``acc_ref.at[:, h:h + N // K, :]`` with more query rows than ``N // K`` is refused as
    out of bounds (an error, never a wrong value)."""
    q, pool, table, starts, lengths, valid = _kernel_case(np.random.default_rng(4), T)
    got = pa.paged_attention_kernel(q, pool, table, starts, lengths, interpret=True,
                                    num_kv_pages_per_block=2, num_queries_per_block=2)
    ref = pa.paged_attention_xla(q, pool, table, starts, lengths)
    np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(ref)[valid], atol=TOL, rtol=TOL)
    assert np.all(np.asarray(got)[~valid] == 0)


def test_kernel_compiles_for_a_tpu_topology():
    """The wrapped kernel through libtpu's compiler (v5e:2x2, one chip): the Mosaic custom call is
    in the program (its cost is the kernel's own business: the compiler's cost analysis does not
    see inside a Mosaic call, so bytes per step are measured in bench/decode_hlo.py)."""
    pytest.importorskip("libtpu")
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jax_rl import compile as aot

    topo = aot.get_topology("v5e:2x2")
    mesh = Mesh(np.array(topo.devices[:1]), ("d",))
    sh = NamedSharding(mesh, PartitionSpec())
    B, N, K, H, ps, M, P = 8, 8, 2, 128, 16, 16, 256
    args = [jax.ShapeDtypeStruct(s, d, sharding=sh) for s, d in (
        ((B, 1, N, H), jnp.bfloat16), ((P, ps, 2 * K, H), jnp.bfloat16), ((B, M), jnp.int32),
        ((B,), jnp.int32), ((B,), jnp.int32))]
    fn = jax.jit(lambda *a: pa.paged_attention_kernel(*a, num_kv_pages_per_block=4, num_queries_per_block=8))
    # the mesh names the TPU for Mosaic's lowering; the suite's fp32 matmul precision is not for bf16 kernels
    with aot.no_persistent_cache(), jax.set_mesh(mesh), jax.default_matmul_precision("default"):
        compiled = fn.lower(*args).compile()
    assert "ragged_paged_attention" in compiled.as_text()


def test_sharded_kernel_compiles_for_a_tpu_topology_mesh():
    """The kernel per shard (shard_map) on a 2-chip tensor mesh of v5e:2x2 through libtpu's compiler:
    each chip's kernel call reads its own q heads [B, N/2, H] and its half of the pool (no collective)."""
    pytest.importorskip("libtpu")
    import re

    from jax.sharding import NamedSharding, PartitionSpec as P

    from jax_rl import compile as aot
    from jax_rl.sharding import make_mesh

    topo = aot.get_topology("v5e:2x2")
    mesh = make_mesh(data=1, fsdp=1, tensor=2, devices=topo.devices[:2])
    B, N, K, H, ps, M, Pg = 8, 8, 2, 128, 16, 16, 256
    rep, heads = NamedSharding(mesh, P()), NamedSharding(mesh, P(None, None, "tensor", None))
    args = [jax.ShapeDtypeStruct(s, d, sharding=sh) for s, d, sh in (
        ((B, 1, N, H), jnp.bfloat16, heads), ((Pg, ps, 2 * K, H), jnp.bfloat16, heads), ((B, M), jnp.int32, rep),
        ((B,), jnp.int32, rep), ((B,), jnp.int32, rep))]
    fn = jax.jit(lambda *a: pa.paged_attention_kernel_sharded(*a, num_kv_pages_per_block=4, num_queries_per_block=8))
    with aot.no_persistent_cache(), jax.set_mesh(mesh), jax.default_matmul_precision("default"):
        txt = fn.lower(*args).compile().as_text()
    call = next(x for x in txt.splitlines() if "custom_call_target=\"tpu_custom_call\"" in x)
    assert re.search(rf"bf16\[{B},{N // 2},{H}\]", call), call[:200]  # the kernel's output: this chip's heads
    assert not re.search(r"all-gather|all-reduce|all-to-all|collective-permute", txt)


def test_kernel_per_shard_on_a_mesh_equals_xla(devices, interpreter_reads_reshaped_refs):
    """The kernel on a (data 2, tensor 2) mesh (``paged_attention_kernel_sharded``: shard_map, rows over
    data, q heads and the pool's combined heads over tensor in whole kv heads), in Pallas TPU interpret
    mode, against the XLA path on one device (fp32, 1e-5): each shard's 2 q heads read its kv head's key
    and value, its 2 rows their pages in the whole (replicated over data) pool."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jax_rl.sharding import make_mesh

    rng = np.random.default_rng(5)
    B, T, N, K, H, ps, M, Pg = 4, 2, 4, 2, 128, 4, 5, 24
    pool = jnp.asarray(rng.standard_normal((Pg, ps, 2 * K, H)), jnp.float32)
    table = jnp.asarray(rng.permutation(Pg)[:B * M].reshape(B, M), jnp.int32)
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
    starts, lengths = jnp.array([6, 0, 13, 3], jnp.int32), jnp.array([2, 1, 2, 1], jnp.int32)
    ref = pa.paged_attention_xla(q, pool, table, starts, lengths)
    mesh = make_mesh(data=2, fsdp=1, tensor=2, devices=devices[:4])
    assert pa.pool_head_spec(N, K, mesh) == ("tensor", "tensor")
    pool = jax.device_put(pool, NamedSharding(mesh, P(None, None, "tensor", None)))
    with jax.set_mesh(mesh):
        got = pa.paged_attention_kernel_sharded(q, pool, table, starts, lengths, interpret=True,
                                                num_kv_pages_per_block=2, num_queries_per_block=2)
    assert got.sharding.spec == P("data", None, "tensor", None)
    valid = np.asarray(jnp.arange(T)[None] < lengths[:, None])
    np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(ref)[valid], atol=TOL, rtol=TOL)


def test_pages_split_over_data_run_the_kernel_per_shard(devices, interpreter_reads_reshaped_refs, monkeypatch):
    """The TPU path of a pool whose pages are split with the slots (``data`` 2: each shard's 2 rows name
    pages of its own sub-pool of 8; ``jax_rl.models.qwen3.paged`` writes and runs the kernel per shard in
    ``shard_map`` on the stacked pool seen as L x P pages), run in Pallas TPU interpret mode rather than only
    compiled: the model's prefill and a decode step give the XLA path's logits (fp32, 1e-5)."""
    import functools

    from flax import nnx

    from jax_rl.models.qwen3 import Qwen3ForCausalLM, get_preset
    from jax_rl.models.qwen3.paged import init_paged_cache, paged_decode_step, paged_extend
    from jax_rl.sharding import make_mesh
    from rollout.engine.paged.programs import paged_pool_spec

    cfg = get_preset("tiny_dense", num_attention_heads=2, num_key_value_heads=1, head_dim=128)  # H % 128
    model = Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0), scan_layers=True)  # the stacked pool, as a TPU engine's
    gd, st = nnx.split(model)
    mesh = make_mesh(data=2, fsdp=1, tensor=1, devices=devices[:2])
    B, ps, M, per = 4, 4, 3, 8
    spec = paged_pool_spec(B, mesh, num_q_heads=2, num_kv_heads=1)
    assert spec[0] == "data"
    rng = np.random.default_rng(6)
    table = np.stack([rng.permutation(per)[:M] for _ in range(B)]).astype(np.int32)  # ids within the shard's pool
    tokens = jnp.asarray(rng.integers(1, cfg.vocab_size, (B, 8)), jnp.int32)
    lengths = jnp.array([8, 3, 6, 1], jnp.int32)
    calls = []
    kernel = functools.partial(pa.paged_attention_kernel, interpret=True, num_kv_pages_per_block=2,
                               num_queries_per_block=2)
    monkeypatch.setattr(pa, "paged_attention_kernel", lambda *a: calls.append(a[1].shape) or kernel(*a))

    def run(st, cache, backend):
        m = nnx.merge(gd, st)
        out = paged_extend(m, tokens, jnp.zeros((B,), jnp.int32), lengths, cache, backend=backend)
        return out.logits, paged_decode_step(m, tokens[:, 0], out.cache, backend=backend).logits

    got = {}
    for backend in ("cpu", "tpu"):
        cache = init_paged_cache(model, B, 2 * per, ps, M, dtype=jnp.float32, pool_spec=spec)
        with jax.set_mesh(mesh):
            got[backend] = jax.jit(run, static_argnums=2)(st, cache.replace(page_table=jnp.asarray(table)), backend)
    # traced once per program (a scanned layer stack), on one shard's pool seen as L x 8 pages
    assert calls == [(cfg.num_hidden_layers * per, ps, 2, 128)] * 2
    valid = np.asarray(jnp.arange(8)[None] < lengths[:, None])
    np.testing.assert_allclose(np.asarray(got["tpu"][0])[valid], np.asarray(got["cpu"][0])[valid], atol=TOL, rtol=TOL)
    np.testing.assert_allclose(np.asarray(got["tpu"][1]), np.asarray(got["cpu"][1]), atol=TOL, rtol=TOL)


def test_kernel_refuses_a_head_dim_off_its_lanes_in_one_line():
    """The TPU kernel tiles heads by 128 lanes: a head_dim of 64 (the tiny models) is one ValueError naming
    rollout.kv_layout, not a Pallas assertion in the lowering (paged is the default layout)."""
    q = jnp.zeros((1, 1, 2, 64), jnp.float32)
    pool = jnp.zeros((4, 16, 2, 64), jnp.float32)
    table = jnp.zeros((1, 2), jnp.int32)
    with pytest.raises(ValueError, match=r"rollout.kv_layout=contiguous.*|head_dim is 64"):
        pa.paged_attention_kernel(q, pool, table, jnp.zeros((1,), jnp.int32), jnp.ones((1,), jnp.int32))
