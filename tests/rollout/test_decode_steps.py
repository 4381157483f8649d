"""``rollout.decode_steps``: n decode steps per engine call (``Qwen3Engine.decode_steps``, one
``lax.scan``) give the same tokens, behaviour log-probs and version tags as one step per call,
with stops and cache ends mid-chunk and weight swaps between chunks."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from jax_rl.models import qwen3 as q
from rollout.decode_loop import DecodeLoop
from rollout.engine import Qwen3Engine, StepOutput
from rollout.generator import Generator

S = 32
N = 4  # decode_steps under test


@pytest.fixture(scope="module")
def engine(model):
    # top_k on: the truncated, renormalised behav_logp
    return Qwen3Engine(model.config, nnx.state(model, nnx.Param), slots=2, max_cache_len=S,
                       dtype="float32", temperature=1.0, top_k=16, kv_layout="contiguous")


def _armed(engine, prompts):
    st = engine.init_decode_state()
    for slot, (prompt, seed) in enumerate(prompts):
        st = engine.insert(engine.prefill_tokens(engine.params, prompt, seed=seed), st, slot)
    return st


def test_decode_steps_equals_repeated_generate_through_the_cache_end(engine):
    # slot 1: 26 cached + 1 pending, 6 free positions: it fills the cache inside the 2nd chunk
    prompts = [([1, 2, 3], 11), (list(range(1, S - 4)), 12)]
    a = _armed(engine, prompts)
    one = []
    for _ in range(2 * N):
        a, out = engine.decode(engine.params, a, version=3)
        one.append(jax.device_get(out))
    b = _armed(engine, prompts)
    b, d1 = engine.decode_steps(engine.params, b, N, version=3)
    b, d2 = engine.decode_steps(engine.params, b, N, version=3)
    d1, d2 = jax.device_get(d1), jax.device_get(d2)
    assert isinstance(d1, StepOutput) and d1.route is None and d1.token.shape == (N, 2)
    for name in ("token", "valid", "generated", "behav_logp", "version"):  # bit-identical
        chunked = np.concatenate([getattr(d1, name), getattr(d2, name)])
        np.testing.assert_array_equal(chunked, np.stack([getattr(o, name) for o in one]), err_msg=name)
    assert [o.generated[0] for o in one] == list(range(1, 2 * N + 1))
    valid = np.concatenate([d1.valid, d2.valid])[:, 1]
    assert valid[:6].all() and not valid[6:].any()  # 6 free positions, then inactive, in chunk 2
    vers = np.concatenate([d1.version, d2.version])
    assert (vers[:, 0] == 3).all() and (vers[:6, 1] == 3).all() and (vers[6:, 1] == -1).all()
    assert d1.at(2).token.shape == (2,) and d1.at(2).token[0] == d1.token[2, 0]
    assert int(np.asarray(b["cache"].lengths)[0]) == 3 - 1 + 2 * N
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):  # same cache, keys, lengths
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    with pytest.raises(ValueError, match="n >= 1"):
        engine.decode_steps(engine.params, b, 0)


def _run(engine, decode_steps, prompts, budgets, stop_ids=()):
    gen = Generator(engine, decode_steps=decode_steps)
    futs = [gen.submit(p, max_new_tokens=m, seed=100 + i, stop_ids=stop_ids)
            for i, (p, m) in enumerate(zip(prompts, budgets))]
    gen.run_until_idle()
    return [f.result() for f in futs], gen


def test_generator_decode_steps_identical_with_stops_budgets_and_cache_end(engine):
    # 4 requests on 2 slots (continuous batching; the later ones are admitted at other steps
    # with decode_steps=4): a budget of 6 (mid-chunk), one that reaches the cache end after 5
    # tokens (mid-chunk), and free runs; then a stop id taken from a free run
    prompts = [[5, 6, 7], list(range(3, S - 2)), [9, 10], [11, 12, 13, 14]]
    budgets = [6, 40, 13, 10]
    ref, _ = _run(engine, 1, prompts, budgets)
    assert [c.finish_reason for c in ref] == ["length"] * 4
    assert [len(c.tokens) for c in ref] == [6, S - len(prompts[1]), 13, 10]
    # stop at request 2's 3rd token (index 2: mid-chunk), unless it occurs earlier in any request
    stop = ref[2].tokens[2]
    ref_s, _ = _run(engine, 1, prompts, budgets, stop_ids=[stop])
    assert ref_s[2].finish_reason == "stop" and len(ref_s[2].tokens) <= 3
    for want, stops in ((ref, ()), (ref_s, [stop])):
        got, gen = _run(engine, N, prompts, budgets, stop_ids=stops)
        for w, g in zip(want, got):
            assert g.tokens == w.tokens and g.finish_reason == w.finish_reason
            assert g.behav_logp.tolist() == w.behav_logp.tolist()  # bit-identical floats
            assert g.versions.tolist() == w.versions.tolist() == [0] * len(w.tokens)
            assert "kept_mass" not in g.info  # the learner recomputes a truncation: nothing carries it
        assert N * gen.stats["calls"] > gen.stats["steps"] > gen.stats["calls"]  # short calls near the ends
        assert gen.stats["discarded_tokens"] > 0  # slots that finished mid-chunk decoded on


def _spied(engine, monkeypatch):
    """Record the step count of every decode call the engine runs (1 for ``decode``)."""
    calls: list[int] = []
    decode, steps = engine.decode, engine.decode_steps

    def spy_decode(*a, **k):
        calls.append(1)
        return decode(*a, **k)

    def spy_steps(params, state, n, **k):
        calls.append(int(n))
        return steps(params, state, n, **k)

    monkeypatch.setattr(engine, "decode", spy_decode)
    monkeypatch.setattr(engine, "decode_steps", spy_steps)
    return calls


@pytest.mark.parametrize("prompts,budgets,want_calls", [
    ([[5, 6, 7], [9, 10]], [1, 1], [1]),  # a 1-token request: one 1-step program, no discarded step
    ([[5, 6, 7], [9, 10]], [6, 2], [4, 2]),  # the chunk shrinks to the largest remaining budget
    ([[5, 6, 7], [9, 10]], [3, 1], [4]),  # rounded up to a compiled count (1, 2, 4)
    ([list(range(1, S - 1)), [9]], [40, 2], [2]),  # capped by the cache room (2 positions left)
])
def test_a_call_runs_no_more_steps_than_the_live_slots_can_use(engine, monkeypatch, prompts, budgets, want_calls):
    # the fixed N-step path (every call a whole decode_steps scan, as before)
    monkeypatch.setattr(DecodeLoop, "call_steps", lambda self: self.opts.decode_steps)
    ref, gen_ref = _run(engine, N, prompts, budgets)
    monkeypatch.undo()
    calls = _spied(engine, monkeypatch)
    got, gen = _run(engine, N, prompts, budgets)
    assert gen.step_counts == (1, 2, 4)
    assert calls == want_calls and gen.stats["steps"] == sum(want_calls)
    assert gen_ref.stats["steps"] == N * len(want_calls)
    for w, g in zip(ref, got):
        assert g.tokens == w.tokens and g.finish_reason == w.finish_reason
        assert g.behav_logp.tobytes() == w.behav_logp.tobytes() and np.array_equal(g.versions, w.versions)  # bit-identical
    assert [len(c.tokens) for c in got] == [min(b, S - len(p)) for p, b in zip(prompts, budgets)]


def test_step_counts_are_powers_of_two_below_decode_steps(engine):
    assert Generator(engine, decode_steps=1).step_counts == (1,)
    assert Generator(engine, decode_steps=6).step_counts == (1, 2, 4, 6)
    assert Generator(engine, decode_steps=16).step_counts == (1, 2, 4, 8, 16)


@pytest.mark.parametrize("partial", ["continue", "recompute_kv", "abort"])
def test_weight_swap_between_chunks_tags_versions(engine, params2, partial):
    p2 = engine.load_params(params2)
    prompts, budgets = [[1, 2, 3, 4], [8, 9]], [11, 9]

    def run(decode_steps, swap_after_steps):
        gen = Generator(engine, decode_steps=decode_steps, partial=partial)
        futs = [gen.submit(p, max_new_tokens=m, seed=7 + i) for i, (p, m) in enumerate(zip(prompts, budgets))]
        for _ in range(swap_after_steps // decode_steps):
            gen.step()
        gen.update_params(p2, 1)
        gen.run_until_idle()
        return [f.result() for f in futs]

    ref, got = run(1, N), run(N, N)  # the swap lands after N tokens in both
    for w, g in zip(ref, got):
        assert g.tokens == w.tokens and g.behav_logp.tolist() == w.behav_logp.tolist() and g.versions.tolist() == w.versions.tolist()
        assert g.info["reissues"] == w.info["reissues"] and g.info["recomputes"] == w.info["recomputes"]
    if partial == "abort":  # the partial turns were dropped and re-issued under version 1
        assert all(set(g.versions) == {1} for g in got)
    else:
        assert all(g.versions.tolist() == [0] * N + [1] * (len(g.tokens) - N) for g in got)
    # the new params really produce the later tokens: not the tokens an unswapped run samples
    plain, _ = _run(engine, N, prompts, budgets)
    assert any(g.behav_logp.tolist() != p.behav_logp.tolist() for g, p in zip(got, plain))


def test_decode_steps_validated(engine):
    with pytest.raises(ValueError, match="decode_steps"):
        Generator(engine, decode_steps=0)


def test_routes_recorded_per_step_are_the_same_in_chunks():
    """MoE routing replay: the expert-id columns of each step come through ``decode_steps``
    stacked like the rest, so ``Completion.routes`` does not depend on decode_steps."""
    moe = q.Qwen3ForCausalLM(q.get_preset("tiny_moe"), rngs=nnx.Rngs(0))
    eng = Qwen3Engine(moe.config, nnx.state(moe, nnx.Param), slots=2, max_cache_len=S,
                      dtype="float32", record_routes=True, kv_layout="contiguous")
    prompts, budgets = [[1, 2, 3], [4, 5, 6, 7], [8, 9]], [6, 9, 5]  # 3 requests on 2 slots
    ref, _ = _run(eng, 1, prompts, budgets)
    got, _ = _run(eng, N, prompts, budgets)
    for w, g in zip(ref, got):
        assert g.tokens == w.tokens and g.behav_logp.tolist() == w.behav_logp.tolist()
        assert g.routes is not None and g.routes.shape[0] == len(prompts[g.request_id]) + len(g.tokens)
        np.testing.assert_array_equal(g.routes, w.routes)
