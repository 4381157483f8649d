"""A paged engine on a rollout mesh (``Qwen3Engine(kv_layout="paged", mesh=...)``, issue 46): the page
pool split over ``tensor`` in whole kv heads and its pages over the axes that split the slots (``data`` /
``expert``: a sub-pool per shard of slots, page ids per shard), the page table and per-slot vectors
replicated, and the same tokens and behav_logp (fp32, 1e-5) as the colocated paged engine and the
sharded contiguous engine over a GRPO group shared by page reference (within a shard), decode, an
append-prefill turn and a fresh request reading the group's prefix pages; the compiled programs never
move K/V between shards; the generator's admission and preemption count pages per shard; JetStream's insert writes a
prefix into its slot's shard only."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jax_rl.models import qwen3 as q
from jax_rl.sharding import make_mesh
from rollout.engine import Qwen3Engine, SlotPrefill

S, PS = 64, 8
A, B = list(range(3, 23)), list(range(40, 51))  # 19 context positions (2 full pages + 3), 10


def _mesh(devices, data=1, expert=1):
    return make_mesh(data=data, fsdp=1, tensor=2, expert=expert, devices=devices[8 - 2 * data * expert:])


def _turns(eng):
    """A group of 3 on prompt A (one prefill, pages shared), B greedy in slot 3; 5 decode steps (1 + a
    4-step scan); then slot 3's next turn (append-prefill on its pages) and a fresh A in slot 0 (its 2
    full pages referenced); 4 more steps. Returns (tokens, logp where valid, prefill tokens, state)."""
    st = eng.init_decode_state()
    rows = [SlotPrefill(A, slot=i, seed=i + 1) for i in range(3)] + [SlotPrefill(B, slot=3, seed=4, temperature=0.0)]
    st, res = eng.prefill_slots(eng.params, st, rows)
    outs = []
    st, o = eng.decode(eng.params, st)
    outs.append(jax.tree.map(lambda x: np.asarray(x)[None], (o.token, o.behav_logp, o.valid)))
    st, o = eng.decode_steps(eng.params, st, 4)
    outs.append(jax.tree.map(np.asarray, (o.token, o.behav_logp, o.valid)))
    gen3 = [int(t) for t in np.concatenate([x[0] for x in outs])[:, 3]]
    turn2 = [SlotPrefill(B + gen3 + [7, 8, 9], slot=3, seed=4, start=10 + len(gen3)), SlotPrefill(A, slot=0, seed=9)]
    st = eng.free_slots(st, [0, 3])
    st, res2 = eng.prefill_slots(eng.params, st, turn2)
    st, o = eng.decode_steps(eng.params, st, 4)
    outs.append(jax.tree.map(np.asarray, (o.token, o.behav_logp, o.valid)))
    tok, lp, valid = (np.concatenate([x[i] for x in outs]) for i in range(3))
    return tok, np.where(valid, lp, 0.0), [r.prefill_tokens for r in res + res2], st


def _collectives(compiled) -> list[str]:
    return re.findall(r"= (\S+) (?:all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(",
                      compiled.as_text())


def test_paged_engine_on_a_data_tensor_mesh_equals_colocated_paged_and_sharded_contiguous(model, devices):
    """data 2 x tensor 2: slots 0-1 and their pages on shard 0, slots 2-3 on shard 1 (P / 2 pages each)."""
    p = nnx.state(model, nnx.Param)
    kw = dict(slots=4, max_cache_len=S, dtype="float32")
    mesh = _mesh(devices, data=2)
    paged = Qwen3Engine(model.config, p, kv_layout="paged", kv_page_size=PS, **kw)
    sharded = Qwen3Engine(model.config, p, kv_layout="paged", kv_page_size=PS, mesh=mesh, **kw)
    contiguous = Qwen3Engine(model.config, p, mesh=mesh, kv_layout="contiguous", **kw)
    t0, l0, p0, _ = _turns(paged)
    t1, l1, p1, st = _turns(sharded)
    t2, l2, _, _ = _turns(contiguous)
    np.testing.assert_array_equal(t1, t0)
    np.testing.assert_array_equal(t1, t2)
    np.testing.assert_allclose(l1, l0, atol=1e-5, rtol=0)
    np.testing.assert_allclose(l1, l2, atol=1e-5, rtol=0)
    assert np.all(l1[l1 != 0] < 0)
    # one prefill for the group per shard (slot 2's shard computes A again: no page crosses shards), the
    # turn's 3 new tokens, the fresh A in slot 0 from its shard's 2 published full pages
    assert p0 == [19, 0, 0, 10, 3, 19 - 16] and p1 == [19, 0, 19, 10, 3, 19 - 16]
    kv, pool = sharded.kv.stats(), sharded.kv.pool
    assert sharded.kv.shards == 2 and [sharded.kv.shard_of(s) for s in range(4)] == [0, 0, 1, 1]
    assert kv["kv_prefix_page_hits"] == 2 and kv == {k: sum(sh.stats()[k] for sh in pool.shards) for k in kv}
    assert kv["kv_pages_in_use"] > paged.kv.stats()["kv_pages_in_use"]  # slot 2's own copy of A's full pages
    half = pool.pages_per_shard
    table = sharded.kv._table
    assert half == 4 * S // PS // 2 and np.all(table < half)  # page ids within a shard's sub-pool
    assert table[1, 0] == table[0, 0] and table[1, 1] == table[0, 1]  # the fresh A in 0 references 1's pages
    assert set(pool.shards[1].seqs) == {2, 3} and set(pool.shards[0].seqs) == {0, 1}

    # placement: params as the sharded contiguous engine's; each layer's pool [P, ps, 2K, H] split on its
    # pages over data and its combined head axis over tensor (2 kv heads: one per shard, its key and
    # value together), the rest replicated
    assert sharded.params["layers"][0]["attn"]["k_proj"].sharding.spec == P(None, "tensor", None)
    cache = st["cache"]
    assert all(x.sharding.spec == P("data", None, "tensor", None) for x in cache.kv)
    assert all(x.sharding.shard_shape(x.shape) == (x.shape[0] // 2, PS, 2, x.shape[3]) for x in cache.kv)
    assert cache.page_table.sharding.spec == P() and cache.lengths.sharding.spec == P()
    assert st["tokens"].sharding.spec == P()
    ids = {d.id for d in mesh.devices.flat}
    assert all({d.id for d in x.sharding.device_set} == ids for x in jax.tree.leaves((sharded.params, st)))

    # no program moves K/V between shards (the pool, or the pages a step gathers from it): the only
    # collectives are over [rows, tokens, D or V] activations (the head-split o_proj's partial sums
    # reduced, the vocab-split logits gathered) and the [B] per-slot vectors (replicated, from rows
    # split over data)
    i32 = lambda n: jnp.zeros((n,), jnp.int32)  # noqa: E731
    with jax.set_mesh(mesh):
        progs = sharded.programs
        compiled = [progs["decode"].lower(sharded.params, st, jnp.int32(0), num_pages=4).compile(),
                    progs["append_prefill"].lower(sharded.params, st, jnp.zeros((4, 16), jnp.int32), i32(4), i32(4),
                                                  i32(4), i32(4), jnp.zeros((4,), jnp.uint32), jnp.ones((4,)),
                                                  num_pages=4).compile(),
                    progs["copy_pages"].lower(st, i32(2), i32(2)).compile()]
    shapes = [tuple(int(d) for d in re.match(r"\w+\[([\d,]*)\]", s).group(1).split(",")) for c in compiled
              for s in _collectives(c)]
    D, V = model.config.hidden_size, model.config.vocab_size
    assert shapes and all((len(s) == 3 and s[-1] in (D, V)) or s == (4,) for s in shapes), shapes
    assert not _collectives(compiled[2])


def test_pool_layout_on_meshes_and_per_shard_pages(devices):
    """1 kv head on tensor=2: splitting the combined axis [k0, v0] would put the keys on one shard and
    the values on the other, so the pool's heads are whole (as the contiguous cache drops the axis); its
    pages split over the axes that split the slots (data, expert; none that does not divide them), each
    shard's sub-pool holding one sequence (else one line naming rollout.kv_pages). The host pool: a slot
    takes only its shard's pages, prefix pages and forks stay within a shard, the counters sum."""
    import pytest

    from rollout.engine.paged.shards import ShardedPagePool
    from rollout.engine.paged.pool import PoolExhausted

    mc = q.get_preset("tiny_dense", num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    kw = dict(slots=4, max_cache_len=S, dtype="float32", kv_layout="paged", kv_page_size=PS)
    spec = lambda eng: {s.spec for s in eng.state_shardings["cache"].kv}  # noqa: E731
    eng = Qwen3Engine(mc, None, mesh=_mesh(devices), **kw)
    assert spec(eng) == {P(None, None, None, None)} and eng.kv.shards == 1
    dense = q.get_preset("tiny_dense")
    eng = Qwen3Engine(dense, None, mesh=_mesh(devices, expert=2), **kw)
    assert spec(eng) == {P("expert", None, "tensor", None)} and eng.kv.shards == 2
    assert eng.state_shardings["cache"].page_table.spec == P()
    eng = Qwen3Engine(dense, None, mesh=_mesh(devices, data=2), **{**kw, "slots": 3})  # 3 slots do not split
    assert spec(eng) == {P(None, None, "tensor", None)} and eng.kv.shards == 1
    with pytest.raises(ValueError, match=r"rollout.kv_pages=12 pages of 8 positions split over 2 shards .* hold 48 < "):
        Qwen3Engine(dense, None, mesh=_mesh(devices, data=2), **{**kw, "kv_pages": 12})

    pool = ShardedPagePool(2, 4, PS, slots=4)
    ctx = list(range(2 * PS + 1))
    assert pool.admit(0, ctx, 0) == 0 and pool.ensure(0, len(ctx)) == []
    assert pool.publish(0, ctx) == [(0, 0), (0, 1)]
    assert pool.admit(1, ctx, 0) == 2 * PS and pool.admit(2, ctx, 0) == 0  # a hit in shard 0 only
    assert pool.table(2, 4).tolist() == [0, 1, 2, -1]  # shard 1's own page ids
    with pytest.raises(ValueError, match="different shards"):
        pool.fork(0, 3)
    with pytest.raises(PoolExhausted):  # shard 0: 3 + 1 pages in use; shard 1's free page is not its
        pool.ensure(1, 4 * PS)
    assert pool.pages_available(0) == 0 and pool.pages_available(1) == 1
    st = pool.stats()
    assert st["kv_pages_in_use"] == 7 and st["kv_prefix_page_hits"] == 2 and st["kv_sequences"] == 3


def test_generator_on_a_sharded_paged_engine_with_preemption(model, devices):
    """The Generator (admission by free pages, preemption of an active request and its re-prefill:
    rollout/kv_pressure.py) over the paged engine on an expert 2 x tensor 2 mesh with a pool of one
    sequence per shard of slots (8 pages of 8 for each 2 slots): the tokens and behav_logp (greedy, fp32,
    1e-5) of the colocated paged engine with a pool that never runs short."""
    from rollout.generator import Generator

    def gen(pages, mesh=None):
        eng = Qwen3Engine(model.config, nnx.state(model, nnx.Param), slots=4, max_cache_len=S, dtype="float32",
                          temperature=0.0, kv_layout="paged", kv_page_size=PS, kv_pages=pages, mesh=mesh)
        return Generator(eng, decode_steps=2, prefix_cache=0)

    prompts = [list(range(3 + i, 16 + 2 * i)) for i in range(5)]
    out = {}
    for name, g in (("ref", gen(4 * S // PS)), ("sharded", gen(2 * S // PS, _mesh(devices, expert=2)))):
        futs = [g.submit(p, max_new_tokens=24, seed=i) for i, p in enumerate(prompts)]
        g.run_until_idle()
        out[name] = ([f.result() for f in futs], g.kv_stats())
    (ref, _), (got, kv) = out["ref"], out["sharded"]
    assert kv["kv_preempted_requests"] > 0 and kv["kv_reprefill_tokens"] > 0
    for a, b in zip(ref, got):
        assert b.tokens == a.tokens and len(b.tokens) == 24
        np.testing.assert_allclose(b.behav_logp, a.behav_logp, atol=1e-5, rtol=0)


def test_jetstream_insert_into_each_shard_of_a_split_pool_equals_contiguous(model, devices):
    """JetStream's ``insert`` / ``generate`` (``jax-rl serve``) on a pool split over data 2 (slots 0-1 on shard 0,
    2-3 on shard 1): a prefix written into slot 1's and slot 2's sub-pools (their shard-local page ids, the other
    shard writing nothing), then over slot 2 again with a shorter prefix, decoded across page boundaries: the
    colocated contiguous engine's tokens and behav_logp (fp32, 1e-5)."""
    from rollout.engine import unpack_result

    p = nnx.state(model, nnx.Param)
    kw = dict(slots=4, max_cache_len=S, dtype="float32", temperature=1.0)
    engines = (Qwen3Engine(model.config, p, kv_layout="contiguous", **kw),
               Qwen3Engine(model.config, p, kv_layout="paged", kv_page_size=PS, mesh=_mesh(devices, data=2), **kw))
    runs = []
    for eng in engines:
        st, out = eng.init_decode_state(), []
        for prompt, slot, seed, steps in ((A, 1, 1, 0), (B, 2, 2, 6), (B[:3], 2, 3, 7)):
            st = eng.insert(eng.prefill_tokens(eng.params, prompt, seed=seed), st, slot)
            for _ in range(steps):
                st, res = eng.generate(eng.params, st)
                r = unpack_result(res)
                out.append(np.where(r["valid"], r["tokens"], -1).tolist() + np.where(r["valid"], r["behav_logp"], 0).tolist())
        runs.append(np.asarray(out))
    np.testing.assert_array_equal(runs[1][:, :4], runs[0][:, :4])
    np.testing.assert_allclose(runs[1][:, 4:], runs[0][:, 4:], atol=1e-5, rtol=0)
    assert (runs[0][:, [1, 2]] >= 0).all()
