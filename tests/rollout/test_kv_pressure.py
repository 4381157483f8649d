"""A paged engine's pool running short under the Generator (rollout/kv_pressure.py, issue 46): requests
wait in the queue for pages (counted), a decode call that lacks pages preempts the most recently admitted
active request, which is re-prefilled with what it generated and finishes with the tokens and behav_logp
of a run on a pool that never preempts (greedy, fp32, 1e-5); a pool that cannot hold one sequence is a
one-line error naming the key."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from jax_rl.config import CONFIG_DIR, ConfigError, load_config
from jax_rl.model_builder import build_model_config
from jax_rl.runtime.resources import kv_page_bytes, kv_pool_pages
from rollout.engine import Qwen3Engine
from rollout.generator import Generator

S, PS, SLOTS = 64, 8, 4


def _gen(model, pages, decode_steps=2):
    eng = Qwen3Engine(model.config, nnx.state(model, nnx.Param), slots=SLOTS, max_cache_len=S, dtype="float32",
                      temperature=0.0, kv_layout="paged", kv_page_size=PS, kv_pages=pages)
    return Generator(eng, decode_steps=decode_steps, prefix_cache=0)


def _submit(gen, prompts, max_new):
    return [gen.submit(p, max_new_tokens=max_new, seed=i) for i, p in enumerate(prompts)]


def _run(gen, prompts, max_new):
    futs = _submit(gen, prompts, max_new)
    gen.run_until_idle()
    return [f.result() for f in futs]


def test_active_slots_preempted_resume_with_the_unpreempted_tokens_and_logp(model):
    # 6 requests of 5-12 prompt tokens + 40 generated: up to 7 pages each, 4 decoding at once, 8 pages in all
    prompts = [list(range(3 + i, 8 + 2 * i)) for i in range(6)]
    big, small = _gen(model, SLOTS * S // PS), _gen(model, S // PS)
    ref, out = _run(big, prompts, 40), _run(small, prompts, 40)
    assert big.kv_stats()["kv_preemptions"] == 0 and big.stats["kv_preempted_requests"] == 0
    kv = small.kv_stats()
    assert kv["kv_preempted_requests"] > 0 and kv["kv_preemptions"] >= kv["kv_preempted_requests"]
    assert kv["kv_reprefill_tokens"] > 0 and kv["kv_admission_waits"] > 0
    assert sum(c.info["preemptions"] for c in out) == kv["kv_preempted_requests"]
    for a, b in zip(ref, out):
        assert a.finish_reason == b.finish_reason == "length" and len(b.tokens) == 40
        assert b.tokens == a.tokens
        np.testing.assert_allclose(b.behav_logp, a.behav_logp, atol=1e-5)
        np.testing.assert_array_equal(b.versions, a.versions)
    assert small.engine.kv.pool.pages_in_use <= S // PS


def test_admission_waits_for_pages_in_order(model):
    gen = _gen(model, S // PS)
    # 20-token prompts: 19 context positions + 2 decode steps = 3 pages each; 8 pages admit two
    prompts = [list(range(10 * i + 1, 10 * i + 21)) for i in range(4)]
    futs = _submit(gen, prompts, 6)
    gen.step()
    assert gen.num_active == 2 and gen.num_queued == 2
    assert gen.stats["kv_admission_waits"] == 1
    assert sorted(r.request_id for r in gen._slots if r is not None) == [f.request_id for f in futs[:2]]
    gen.run_until_idle()
    assert all(len(f.result().tokens) == 6 for f in futs)
    assert gen.kv_stats()["kv_preempted_requests"] == 0


def test_pool_size_errors_name_the_key(tmp_path):
    cfg_path = CONFIG_DIR / "tiny_cpu.yaml"
    with pytest.raises(ConfigError, match=r"rollout.kv_pages=7 .* < rollout.max_cache_len=128: .*at least 8 pages"):
        load_config(cfg_path, ["rollout.kv_layout=paged", "rollout.kv_pages=7"])
    with pytest.raises(ConfigError, match="rollout.kv_pages=64 and rollout.kv_pool_gib=1.0 both size"):
        load_config(cfg_path, ["rollout.kv_layout=paged", "rollout.kv_pages=64", "rollout.kv_pool_gib=1"])
    cfg = load_config(cfg_path, ["rollout.kv_layout=paged", "rollout.dtype=float32"])
    mc = build_model_config(cfg)
    per = 16 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * 2 * 4  # fp32 K and V of 16 positions
    assert kv_page_bytes(cfg, mc) == per
    assert kv_pool_pages(cfg, mc) == 32 * 8  # the default: slots x ceil(max_cache_len / kv_page_size)
    gib = 100 * per / 2**30 + 1e-9
    cfg = load_config(cfg_path, ["rollout.kv_layout=paged", "rollout.dtype=float32", f"rollout.kv_pool_gib={gib}"])
    assert kv_pool_pages(cfg, mc) == 100
    cfg = load_config(cfg_path, ["rollout.kv_layout=paged", "rollout.dtype=float32", f"rollout.kv_pool_gib={7 * per / 2**30}"])
    with pytest.raises(ConfigError) as e:
        kv_pool_pages(cfg, mc)
    assert str(e.value).startswith("rollout.kv_pool_gib=") and "(7 pages of" in str(e.value) and "\n" not in str(e.value)


class _Bookkeeping:
    """The engine attributes a Generator reads at construction and at a swap (no program runs here)."""

    max_concurrent_decodes, max_cache_len, params, kv_layout = 2, S, {"w": 0}, "paged"

    def init_decode_state(self):
        return {}

    def load_params(self, params):
        return params


@pytest.mark.parametrize("partial", ["abort", "recompute_kv", "continue"])
def test_a_swap_reaches_the_preempted_requests_waiting_in_the_queue(partial):
    gen = Generator(_Bookkeeping(), partial=partial, prefix_cache=0)
    short, long = gen.submit([1, 2, 3], max_new_tokens=4), gen.submit([4, 5], max_new_tokens=10)
    for req, n in zip(list(gen._queue), (4, 3)):  # as _make_room leaves them: tokens generated, re-queued
        req.tokens = list(range(7, 7 + n))
        req.behav_logp, req.versions = np.zeros(10, np.float32), np.zeros(10, np.int32)
        req.preemptions = 1
    gen.update_params({"w": 1}, 1)
    gen._apply_pending()
    waiting = list(gen._queue)
    if partial == "abort":  # the partial turn dropped and re-issued with what is left of the budget
        assert short.result().finish_reason == "aborted" and short.result().info["dropped_tokens"] == 4
        (req,) = waiting
        assert req.tokens == [] and req.budget == 7 and req.dropped == 3 and req.reissues == 1
    else:  # re-prefilled by the new params when admitted: a recompute, tokens kept
        assert [len(r.tokens) for r in waiting] == [4, 3] and all(r.recomputes == 1 for r in waiting)
        assert gen.stats["recomputes"] == 2 and not short.done()
