"""RL with the roles on their own devices (docs/placement.md), end to end on the 8 fake devices:
``placement.learner=4 placement.rollout=4 rollout.mesh.tensor=2`` (the learner's mesh on devices
0-3, one rollout engine sharded (data 2, tensor 2) on devices 4-7, the eval engine on the same
mesh). The engines really are sharded there, every trained token carries the version of the
params that generated it (within async.max_staleness of the learner's), and the publishes are
timed (weight_sync_s)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jax_rl.runtime import engines as E
from jax_rl.runtime.train import run_train

from .test_train import _cfg, _rows

PLACED = ["placement.learner=4", "placement.rollout=4", "rollout.mesh.tensor=2", "run.steps=4", "eval.every=0",
          "async.max_staleness=1"]


@pytest.mark.timeout(300)
def test_train_with_separate_sharded_rollout(tmp_path, devices, monkeypatch):
    engines, batches = [], []
    from jax_rl.learner import batch as B

    build, collate = E.build_generator, B.learner_batch

    def spy_build(*a, **kw):
        gen = build(*a, **kw)
        engines.append(gen.engine)
        return gen

    def spy_batch(cfg, groups, pad_id, **kw):
        out = collate(cfg, groups, pad_id, **kw)
        batches.append((np.asarray(out[2]["versions"]), np.asarray(out[2]["loss_mask"])))
        return out

    monkeypatch.setattr(E, "build_generator", spy_build)
    monkeypatch.setattr(B, "learner_batch", spy_batch)
    cfg = _cfg(tmp_path, *PLACED)
    assert run_train(cfg) == 0

    # the rollout engine and the eval engine: on devices 4-7, params and KV cache sharded on 'tensor'
    assert len(engines) == 2
    for eng in engines:
        assert dict(eng.mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 2, "expert": 1}
        assert {d.id for d in eng.mesh.devices.flat} == {4, 5, 6, 7}
        q_proj = eng.params["layers"][0]["attn"]["q_proj"]
        assert "tensor" in q_proj.sharding.spec and {d.id for d in q_proj.sharding.device_set} == {4, 5, 6, 7}

    rows = _rows(cfg.run.dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["version"] for r in rows] == [1, 2, 3, 4]  # one publish per step
    for r in rows:
        assert r["weight_sync_s"] > 0 and r["weight_sync_cast_s"] > 0
        assert r["staleness_max"] <= 1
    assert len(batches) == 4
    seen = set()
    for step, (versions, loss_mask) in enumerate(batches):  # trained at version `step`
        v = versions[loss_mask]
        assert v.size and np.all(v <= step) and np.all(v >= step - 1), (step, np.unique(v))
        assert np.all(versions[~loss_mask] == -1)
        seen.update(np.unique(v).tolist())
    assert seen & {1, 2, 3}  # tokens of published versions came back from the sharded engine


@pytest.mark.slow  # ~75 s here; make test covers the engine and the Generator on a mesh (tests/rollout/test_paged_engine_mesh.py)
@pytest.mark.timeout(300)
def test_train_with_a_paged_sharded_rollout_engine(tmp_path, devices, monkeypatch):
    """rollout.kv_layout=paged on the same placement: the engines are paged and sharded (each layer's
    pool split over tensor on its heads: 2 kv heads here, tiny_cpu's 1 would leave it whole; and over
    data on its pages, as the 4 devices' data axis of 2 splits the slots; the page table replicated),
    the run trains, and its rows carry the pool's counters."""
    from jax.sharding import PartitionSpec as P

    engines = []
    build = E.build_generator
    monkeypatch.setattr(E, "build_generator", lambda *a, **kw: engines.append(build(*a, **kw)) or engines[-1])
    cfg = _cfg(tmp_path, *PLACED, "run.steps=2", "rollout.kv_layout=paged", "rollout.kv_page_size=8",
               # tiny_cpu.yaml's overrides with 2 kv heads (an override replaces the whole dict)
               "model.hf_overrides={num_attention_heads: 2, num_key_value_heads: 2, head_dim: 64, "
               "rope_theta: 10000.0, vocab_size: 640}")
    assert run_train(cfg) == 0
    assert len(engines) == 2
    for gen in engines:
        eng = gen.engine
        assert eng.kv.name == "paged" and {d.id for d in eng.mesh.devices.flat} == {4, 5, 6, 7}
        pool = eng.state_shardings["cache"]
        assert eng.mesh.shape["data"] == 2 and eng.mesh.shape["tensor"] == 2, eng.mesh.shape
        assert all(s.spec == P("data", None, "tensor", None) for s in jax.tree.leaves(pool.kv))
        assert pool.page_table.spec == P()
    rows = _rows(cfg.run.dir)
    assert [r["step"] for r in rows] == [1, 2] and [r["version"] for r in rows] == [1, 2]
    assert all(r["kv_pages_in_use"] >= 0 and r["prefill_tokens"] > 0 for r in rows), rows
