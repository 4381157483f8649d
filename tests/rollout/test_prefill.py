"""The RL engine's prefill (issue 36): batched prefill per length bucket, one prefill per GRPO
group, the K/V cache kept across an episode's turns (append-prefill), the per-step prefill budget.

Every equivalence is against the per-request path (``prefill_tokens`` + ``insert``, one request
per call, the whole conversation re-prefilled each turn) or a model-level reference, fp32."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_rl.models import qwen3 as q
from rollout.engine import PrefillResult, Qwen3Engine, SlotPrefill
from rollout.generator import Generator

S = 64


@pytest.fixture(scope="module")
def engine(model):
    return Qwen3Engine(model.config, nnx.state(model, nnx.Param), slots=4, max_cache_len=S, dtype="float32", kv_layout="contiguous")


class PerRequest:
    """The reference path: the engine whose ``prefill_slots`` runs one batch-1 ``prefill`` +
    ``insert`` per row (JetStream's per-request prefill; no sharing, no append-prefill)."""

    def __init__(self, engine):
        self._e = engine

    def __getattr__(self, name):
        return getattr(self._e, name)

    def prefill_slots(self, params, state, rows):
        out = []
        for r in rows:
            assert r.start == 0, "the reference prefills whole prompts"
            pre = self._e.prefill_tokens(params, r.tokens, seed=r.seed, temperature=r.temperature)
            state = self._e.insert(pre, state, r.slot)
            out.append(PrefillResult(len(r.tokens) - 1, False, pre.get("routes")))
        return state, out


def _prompts(n, lens, seed=0, vocab=100):
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(1, vocab, size=L))) for L in lens][:n]


def _decode(eng, st, steps=6):
    out = []
    for _ in range(steps):
        st, r = eng.decode(eng.params, st)
        out.append(jax.device_get(r))
    return np.stack([o.token for o in out]), np.stack([o.behav_logp for o in out])


def _close(a, b, tol):
    assert a.tokens == b.tokens
    np.testing.assert_allclose(a.behav_logp, b.behav_logp, rtol=0, atol=tol)
    assert a.versions.tolist() == b.versions.tolist()


# ------------------------------------------------------------------ (1) batched prefill


@pytest.mark.parametrize("per_layer", [True, False], ids=["per_layer_cache", "stacked_cache"])
def test_prefill_slots_equals_per_request_prefill(model, per_layer):
    """Rows in two length buckets (3 rows in one: a padding row), one row prefilled for two slots;
    then 6 decode steps: the same tokens and log-probs (fp32, 1e-6) as one prefill + insert per
    request."""
    eng = Qwen3Engine(model.config, nnx.state(model, nnx.Param), slots=4, max_cache_len=S, dtype="float32",
                      kv_per_layer=per_layer, kv_layout="contiguous")
    prompts = _prompts(4, [5, 9, 9, 20])
    prompts[2] = prompts[1]  # a group of two
    st = eng.init_decode_state()
    for i, p in enumerate(prompts):
        st = eng.insert(eng.prefill_tokens(eng.params, p, seed=10 + i, temperature=1.0), st, i)
    want_t, want_l = _decode(eng, st)
    st, res = eng.prefill_slots(eng.params, eng.init_decode_state(),
                                [SlotPrefill(p, i, 10 + i, 1.0) for i, p in enumerate(prompts)])
    got_t, got_l = _decode(eng, st)
    np.testing.assert_array_equal(got_t, want_t)
    np.testing.assert_allclose(got_l, want_l, rtol=0, atol=1e-6)
    assert [r.prefill_tokens for r in res] == [4, 8, 0, 19] and [r.shared for r in res] == [0, 0, 1, 0]
    assert not np.array_equal(got_t[:, 1], got_t[:, 2])  # the group's two samples: their own seeds


def test_prefill_slots_validates(engine):
    st = engine.init_decode_state()
    for rows, match in [([SlotPrefill([1, 2], 4)], "slot"), ([SlotPrefill([1, 2], 0), SlotPrefill([3], 0)], "twice"),
                        ([SlotPrefill([], 0)], "tokens"), ([SlotPrefill([1] * (S + 1), 0)], "tokens"),
                        ([SlotPrefill([1, 2], 0, start=2)], "start")]:
        with pytest.raises(ValueError, match=match):
            engine.prefill_slots(engine.params, st, rows)


def test_generator_admits_a_burst_in_one_call_per_bucket(engine):
    """8 requests on 4 slots, two length buckets: the generator's completions equal the per-request
    path's (fp32, 1e-6), with fewer prefill calls than requests."""
    prompts = _prompts(8, [3, 5, 17, 4, 20, 6, 7, 18], seed=1)
    budgets = [5, 3, 6, 4, 2, 6, 5, 3]

    def run(eng):
        gen = Generator(eng)
        futs = [gen.submit(p, max_new_tokens=b, seed=i) for i, (p, b) in enumerate(zip(prompts, budgets))]
        gen.run_until_idle()
        return [f.result(timeout=0) for f in futs], gen.stats

    got, st = run(engine)
    want, _ = run(PerRequest(engine))
    for g, w in zip(got, want):
        _close(g, w, 1e-6)
    assert st["prefills"] == 8 and st["prefill_calls"] < 8
    assert st["prefill_tokens"] == sum(len(p) - 1 for p in prompts)
    assert sum(g.info["prefill_tokens"] for g in got) == st["prefill_tokens"]


# ------------------------------------------------------------------ (2) one prefill per GRPO group


def test_group_prefilled_once_equals_separate_prefills(engine):
    """A GRPO group of 4 samples (one prompt, 4 seeds) prefills once and copies its K/V into 4
    slots; each sample equals its own separate prefill (fp32, 1e-6) and the samples differ."""
    prompt = _prompts(1, [11], seed=2)[0]
    gen = Generator(engine)
    got = gen.generate([prompt] * 4, max_new_tokens=8, seeds=[5, 6, 7, 8])
    assert gen.stats["prefill_tokens"] == len(prompt) - 1 and gen.stats["shared_prefills"] == 3
    assert [g.info["shared_prefill"] for g in got] == [False, True, True, True]
    for g, seed in zip(got, [5, 6, 7, 8]):
        alone = Generator(PerRequest(engine)).generate([prompt], max_new_tokens=8, seeds=[seed])[0]
        _close(g, alone, 1e-6)
    assert len({tuple(g.tokens) for g in got}) > 1


# ------------------------------------------------------------------ (3) K/V kept across turns


def _episode(gen, prompt, turns, *, session, obs_seed=3, new=5, swap=None, prefix_len=0):
    """A synthetic episode: turn k's context = turn k-1's context + its tokens + 3 'tool' tokens.
    ``swap`` = (params, version) applied between turn 0 and turn 1. Returns the completions."""
    rng = np.random.default_rng(obs_seed)
    ctx, out = list(prompt), []
    for t in range(turns):
        if t == 1 and swap is not None:
            gen.update_params(*swap)
        fut = gen.submit(ctx, max_new_tokens=new, seed=100 + t, session=session, prefix_len=prefix_len)
        gen.run_until_idle()
        c = fut.result(timeout=0)
        out.append(c)
        ctx = ctx + c.tokens + list(map(int, rng.integers(1, 100, size=3)))
    gen.release_session(session)
    return out


def test_kept_kv_episode_equals_reprefilled_episode(engine):
    """Fixed params, 4 turns: the kept-K/V episode (each turn appends only its new tokens) gives the
    re-prefilled episode's tokens and log-probs (fp32, 1e-5) while prefilling far fewer tokens."""
    prompt = _prompts(1, [9], seed=4)[0]
    kept_gen, re_gen = Generator(engine), Generator(engine, keep_kv=False)
    kept = _episode(kept_gen, prompt, 4, session="ep")
    re = _episode(re_gen, prompt, 4, session="ep")
    for a, b in zip(kept, re):
        _close(a, b, 1e-5)
    assert [c.info["kv_reused"] > 0 for c in kept] == [False, True, True, True]
    assert all(c.info["kv_reused"] == 0 for c in re)
    # kept: the prompt, then per later turn the last sampled token + 2 of the 3 tool tokens (the
    # last one stays pending: the first decode step feeds it); re-prefill: every whole context
    assert sum(c.info["prefill_tokens"] for c in kept) == len(prompt) - 1 + 3 * 3
    assert kept_gen.stats["prefill_tokens"] < re_gen.stats["prefill_tokens"] / 2
    kept_gen.step()  # the release is applied at the next step
    assert kept_gen.num_held == 0


def test_kept_kv_survives_a_concurrent_request_and_is_evicted_when_slots_run_out(engine, model):
    """slots=1: a held slot is evicted (counted) when another request needs it; the evicted
    session's next turn re-prefills and still equals the reference."""
    eng = Qwen3Engine(model.config, engine.params, slots=1, max_cache_len=S, dtype="float32", kv_layout="contiguous")
    gen = Generator(eng)
    prompt, other = _prompts(2, [7, 5], seed=5)
    c0 = gen.generate([prompt], max_new_tokens=4, seeds=[1])[0]  # no session: nothing held
    assert gen.num_held == 0
    f = gen.submit(prompt, max_new_tokens=4, seed=1, session="a")
    gen.run_until_idle()
    assert f.result(timeout=0).tokens == c0.tokens and gen.num_held == 1
    gen.generate([other], max_new_tokens=3, seeds=[2])  # needs the only slot
    assert gen.stats["kv_evictions"] == 1 and gen.num_held == 0
    ctx = prompt + c0.tokens + [1, 2, 3]
    f = gen.submit(ctx, max_new_tokens=4, seed=9, session="a")
    gen.run_until_idle()
    c1 = f.result(timeout=0)
    assert c1.info["kv_reused"] == 0 and c1.info["prefill_tokens"] == len(ctx) - 1
    _close(c1, Generator(PerRequest(eng)).generate([ctx], max_new_tokens=4, seeds=[9])[0], 1e-5)


def _slot_kv(eng, st, slot, n):
    """The K/V rows of positions [0, n) of ``slot`` (per-layer cache: k [B,K,H,S], v [B,K,S,H])."""
    c = st["cache"]
    ks = c.k if isinstance(c.k, tuple) else [c.k[i] for i in range(c.k.shape[0])]
    vs = c.v if isinstance(c.v, tuple) else [c.v[i] for i in range(c.v.shape[0])]
    if isinstance(c.k, tuple):
        return [np.asarray(k[slot, ..., :n]) for k in ks] + [np.asarray(v[slot, :, :n]) for v in vs]
    return [np.asarray(k[slot, :, :n]) for k in ks] + [np.asarray(v[slot, :, :n]) for v in vs]


def test_held_slot_does_not_decode_and_keeps_its_kv_while_others_decode(engine, model):
    """A held slot (its session's tool running) is inactive in the engine: while the other slot
    decodes 29 steps (past where the held slot's own cache would end) it emits no valid token, its
    length and its cached K/V stay bit-identical, the hold survives (nothing expires), and the
    session's next turn appends to it and equals the re-prefilled reference."""
    eng = Qwen3Engine(model.config, engine.params, slots=2, max_cache_len=32, dtype="float32", kv_layout="contiguous")
    gen = Generator(eng)
    prompt = _prompts(1, [6], seed=6)[0]
    f = gen.submit(prompt, max_new_tokens=3, seed=1, session="a")
    gen.run_until_idle()
    c0 = f.result(timeout=0)
    held = gen.holds.by_session["a"]
    n = len(held.context)
    g = gen.submit([5, 6], max_new_tokens=29, seed=0)
    gen.step()  # admits the other request; deactivates the held slot before its decode
    assert not bool(np.asarray(gen.table.state["active"])[held.slot])
    before = _slot_kv(eng, gen.table.state, held.slot, n)
    length = int(np.asarray(gen.table.state["cache"].lengths)[held.slot])
    gen.run_until_idle()
    assert len(g.result(timeout=0).tokens) == 29 and gen.num_held == 1
    assert gen.stats["discarded_tokens"] == 0  # the held slot produced no valid token
    assert int(np.asarray(gen.table.state["cache"].lengths)[held.slot]) == length == n
    for x, y in zip(before, _slot_kv(eng, gen.table.state, held.slot, n)):
        np.testing.assert_array_equal(x, y)
    ctx = prompt + c0.tokens + [7, 8]
    f = gen.submit(ctx, max_new_tokens=4, seed=2, session="a")
    gen.run_until_idle()
    c1 = f.result(timeout=0)
    assert c1.info["kv_reused"] == n and gen.stats["kv_evictions"] == 0
    _close(c1, Generator(PerRequest(eng)).generate([ctx], max_new_tokens=4, seeds=[2])[0], 1e-5)


def test_a_prompt_that_does_not_extend_the_held_context_reprefills(engine):
    gen = Generator(engine)
    prompt = _prompts(1, [6], seed=7)[0]
    f = gen.submit(prompt, max_new_tokens=3, seed=1, session="a")
    gen.run_until_idle()
    other = [9] + prompt[1:] + f.result(timeout=0).tokens + [4]  # position 0 differs
    f = gen.submit(other, max_new_tokens=3, seed=2, session="a")
    gen.run_until_idle()
    assert gen.stats["kv_mismatch"] == 1 and f.result(timeout=0).info["kv_reused"] == 0
    _close(f.result(timeout=0), Generator(PerRequest(engine)).generate([other], max_new_tokens=3, seeds=[2])[0], 1e-5)


@pytest.fixture(scope="module")
def mixed_ref(model):
    """lps[t] = log p(seq[c+t+1]) with the K/V of seq[:c] from p_old and seq[c:] decoded one token
    at a time by p_new (the model's decode path: independent of the engine's append-prefill)."""
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def mixed(p_old, p_new, seq, c):
        m_old, m_new = nnx.merge(graphdef, p_old, rest), nnx.merge(graphdef, p_new, rest)
        cache = m_old.prefill(seq, jnp.reshape(c, (1,)), m_old.init_cache(1, S)).cache

        def body(cache, t):
            i = jnp.minimum(c + t, S - 2)
            out = m_new.decode_step(jax.lax.dynamic_slice(seq[0], (i,), (1,)), cache)
            return out.cache, jax.nn.log_softmax(out.logits[0])[seq[0, i + 1]]

        return jax.lax.scan(body, cache, jnp.arange(S - 1))[1]

    return mixed


@pytest.mark.parametrize("partial", ["continue", "recompute_kv", "abort"])
def test_swap_between_turns_follows_partial(engine, params2, mixed_ref, partial):
    """A weight swap while the episode's slot is held (between turn 0 and turn 1):

    * ``continue``: turn 1 appends its new tokens on the version-0 K/V; its log-probs are those of
      the model with seq[:c] cached by version 0 and the rest decoded by version 1 (1e-5);
    * ``recompute_kv`` / ``abort``: the held K/V are dropped (``kv_dropped_swap``) and turn 1
      re-prefills the conversation under version 1: the re-prefilled episode's tokens (1e-5)."""
    prompt = _prompts(1, [8], seed=8)[0]
    p1 = engine.params
    gen = Generator(engine, partial=partial)
    kept = _episode(gen, prompt, 2, session="e", swap=(params2, 1))
    assert kept[0].versions.tolist() == [0] * len(kept[0].tokens) and kept[1].versions.tolist() == [1] * len(kept[1].tokens)
    if partial == "continue":
        assert kept[1].info["kv_reused"] > 0 and gen.stats["kv_dropped_swap"] == 0
        ctx1_len = kept[1].info["prompt_len"]
        c = len(prompt) + len(kept[0].tokens) - 1  # positions cached by version 0
        rng = np.random.default_rng(3)
        seq = prompt + kept[0].tokens + list(map(int, rng.integers(1, 100, size=3))) + kept[1].tokens
        buf = np.zeros((1, S), np.int32)
        buf[0, : len(seq)] = seq
        lps = np.asarray(mixed_ref(p1, engine.load_params(params2), jnp.asarray(buf), jnp.int32(c)))
        want = lps[ctx1_len - 1 - c: ctx1_len - 1 - c + len(kept[1].tokens)]
        np.testing.assert_allclose(kept[1].behav_logp, want, rtol=0, atol=1e-5)
    else:
        assert kept[1].info["kv_reused"] == 0 and gen.stats["kv_dropped_swap"] == 1
        re = _episode(Generator(engine, partial=partial, keep_kv=False), prompt, 2, session="e", swap=(params2, 1))
        for a, b in zip(kept, re):
            _close(a, b, 1e-5)
    gen.update_params(p1, 2)  # the module's engine back at its params for the other tests
    gen.step()


# ------------------------------------------------------------------ (5) prefill never starves decode


def test_prefill_budget_bounds_admission_while_slots_decode(engine):
    """With a slot decoding, a burst of 3 requests (7 prefill tokens each) under a 10-token budget
    is admitted one per step; the outputs equal an unbounded run's."""
    prompts = _prompts(4, [4, 8, 8, 8], seed=9)

    def run(budget):
        gen = Generator(engine, prefill_budget=budget)
        futs = [gen.submit(prompts[0], max_new_tokens=12, seed=0)]
        gen.step()
        futs += [gen.submit(p, max_new_tokens=4, seed=i + 1) for i, p in enumerate(prompts[1:])]
        active = []
        while gen.step():
            active.append(gen.num_active)
        return [f.result(timeout=0) for f in futs], active

    bounded, active = run(10)
    free, free_active = run(None)
    assert active[:3] == [2, 3, 4] and free_active[0] == 4
    for a, b in zip(bounded, free):
        _close(a, b, 1e-6)


# ------------------------------------------------------------------ routing replay (MoE, r3)


def test_r3_exact_for_every_turn_with_kept_kv():
    """MoE, fp32 engine, fixed params, 3 turns with kept K/V, the prompt's first 5 tokens from the
    prefix cache (a second episode hits it): the episode's routes (each position the route its
    cached K/V was computed with) make an r3 learner forward reproduce every turn's log-probs
    (1e-5), and the kept positions keep the routes recorded when they were computed."""
    from rollout.agent import _merge_routes
    from rollout.types import Trajectory
    from tests.learner.test_routing_replay import _batch, _learner

    L = _learner("ppo", "r3", False)
    mc = L.model_config
    p0 = L.get_params(host=True)
    eng = Qwen3Engine(mc, p0, slots=2, max_cache_len=S, dtype="float32", record_routes=True,
                      model_kwargs=dict(scan_layers=False), kv_layout="contiguous")
    gen = Generator(eng)
    prompt = _prompts(1, [8], seed=10, vocab=mc.vocab_size)[0]
    _episode(gen, prompt[:5] + [1, 2, 3], 1, session="first", new=4, prefix_len=5)  # fills the prefix cache
    comps = _episode(gen, prompt, 3, session="m", new=4, prefix_len=5)
    assert [c.info["kv_reused"] > 0 for c in comps] == [False, True, True]
    assert comps[0].info["prefix_hits"] == 1 and gen.stats["prefix_misses"] == 1
    rng = np.random.default_rng(3)
    toks, mask, lp, routes = list(prompt), [False] * len(prompt), [0.0] * len(prompt), None
    for i, c in enumerate(comps):
        if routes is not None:  # a kept position keeps its route
            n = len(routes) - 1
            np.testing.assert_array_equal(c.routes[:n], routes[:n])
        routes = _merge_routes(routes, c.routes)
        toks += c.tokens
        mask += [True] * len(c.tokens)
        lp += c.behav_logp.tolist()
        if i < len(comps) - 1:
            obs = list(map(int, rng.integers(1, 100, size=3)))
            toks += obs
            mask += [False] * 3
            lp += [0.0] * 3
    routes = _merge_routes(routes, np.full((len(toks), *routes.shape[1:]), -1, routes.dtype))
    T = len(toks)
    t = Trajectory(tokens=toks, loss_mask=mask, behav_logp=lp, versions=[0 if m else -1 for m in mask],
                   turn_ids=[0 if m else -1 for m in mask], routes=routes)
    b = _batch([t])
    err = np.abs(L.logprobs(b, params=p0) - b["behav_logp"])[b["loss_mask"]]
    assert err.size == sum(len(c.tokens) for c in comps) and T == len(t)
    assert float(err.max()) < 1e-5


# ------------------------------------------------------------------ (4) metrics.jsonl


def test_step_row_counts_prefill_and_episode_tokens():
    from jax_rl.config import Config
    from jax_rl.runtime.loop import step_row
    from rollout.types import Trajectory

    def traj(n, gen, info):
        return Trajectory(tokens=[1] * n, loss_mask=[False] * (n - gen) + [True] * gen, behav_logp=[0.0] * n,
                          versions=[-1] * (n - gen) + [0] * gen, turn_ids=[-1] * (n - gen) + [0] * gen, info=info)

    trajs = [traj(10, 4, {"prefill_tokens": 5}), traj(7, 2, {"prefill_tokens": 12}), traj(6, 1, {})]
    batch = {"tokens": np.zeros((3, 10), np.int32), "versions": np.zeros((3, 10), np.int32),
             "loss_mask": np.zeros((3, 10), bool)}
    row = step_row(Config(), 1, 1, {}, batch, [trajs], trajs, 0)
    assert row["prefill_tokens"] == 17 and row["episode_tokens"] == 23


# ------------------------------------------------------------------ prefix cache


def test_prefix_cache_serves_a_shared_prefix_per_weight_version(engine, params2):
    """4 prompts sharing a 20-token prefix (an env's system prompt) with different suffixes: the prefix
    is prefilled once (one miss, three hits) and every completion equals a fresh prefill's (1e-5);
    after a weight swap the prefix is a miss again (keyed by version) and the outputs are the new
    params' own."""
    shared = _prompts(1, [20], seed=11)[0]
    prompts = [shared + s for s in _prompts(4, [3, 6, 2, 9], seed=12)]
    gen = Generator(engine)
    futs = [gen.submit(p, max_new_tokens=5, seed=i, prefix_len=20) for i, p in enumerate(prompts)]
    gen.run_until_idle()
    got = [f.result(timeout=0) for f in futs]
    assert gen.stats["prefix_misses"] == 1 and gen.stats["prefix_hits"] == 3
    assert [g.info["prefix_hits"] for g in got] == [0, 1, 1, 1]
    assert gen.stats["prefill_tokens"] == 20 + sum(len(p) - 1 - 20 for p in prompts)
    ref = Generator(PerRequest(engine)).generate(prompts, max_new_tokens=5, seeds=[0, 1, 2, 3])
    for g, w in zip(got, ref):
        _close(g, w, 1e-5)
    gen.update_params(params2, 1)
    f = gen.submit(prompts[1], max_new_tokens=5, seed=1, prefix_len=20)
    gen.run_until_idle()
    assert gen.stats["prefix_misses"] == 2
    ref_gen = Generator(PerRequest(engine), params=engine.load_params(params2), version=1)
    _close(f.result(timeout=0), ref_gen.generate([prompts[1]], max_new_tokens=5, seeds=[1])[0], 1e-5)


def test_prefix_cache_and_group_sharing_combine(engine):
    """A GRPO group (4 samples of one prompt) whose prompt starts with a cached shared prefix: the
    first sample appends its prompt's rest to the prefix, the other three copy its slot
    (``copy_slot``); all equal separate fresh prefills (1e-5)."""
    shared = _prompts(1, [20], seed=13)[0]
    other, prompt = shared + [5, 6], shared + [7, 8, 9, 10]
    gen = Generator(engine)
    gen.generate([other], max_new_tokens=2, seeds=[0])  # no prefix_len: nothing cached
    assert gen.stats["prefix_misses"] == 0
    f = gen.submit(other, max_new_tokens=2, seed=0, prefix_len=20)  # a miss fills the cache
    gen.run_until_idle()
    base = gen.stats["prefill_tokens"]
    futs = [gen.submit(prompt, max_new_tokens=6, seed=s, prefix_len=20) for s in range(4)]
    gen.run_until_idle()
    got = [f.result(timeout=0) for f in futs]
    assert gen.stats["prefix_hits"] == 1 and gen.stats["prefix_misses"] == 1
    assert gen.stats["prefill_tokens"] - base == len(prompt) - 1 - 20
    assert [g.info["shared_prefill"] for g in got] == [False, True, True, True]
    ref = Generator(PerRequest(engine)).generate([prompt] * 4, max_new_tokens=6, seeds=[0, 1, 2, 3])
    for g, w in zip(got, ref):
        _close(g, w, 1e-5)
    assert len({tuple(g.tokens) for g in got}) > 1


# ------------------------------------------------------------------ (6) a row's numerics are its own


@pytest.mark.parametrize("kind", ["fresh", "append"])
def test_a_rows_prefill_is_bit_identical_whatever_shares_its_call(kind):
    """Which requests share a ``prefill_slots`` call depends on when they reached the generator
    (thread timing), so a request's K/V, first token and decode log-probs must not depend on the
    other rows of its call: bit-identical (not 1e-6) alone, with one or three other rows of its
    length bucket, in any row position. (An append-prefill's values changed with the call's row
    count on XLA:CPU, which made a resumed K=0 run differ from the straight one at fp32 rounding:
    tests/runtime/test_train.py::test_resume_k0_identical.)"""
    cfg = dataclasses.replace(q.get_preset("tiny_dense"), num_attention_heads=2, num_key_value_heads=1,
                              head_dim=64, vocab_size=640)
    m = q.Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0))
    eng = Qwen3Engine(cfg, nnx.state(m, nnx.Param), slots=4, max_cache_len=128, dtype="float32", kv_layout="contiguous")
    pre = _prompts(1, [20], seed=3, vocab=600)[0]
    start = len(pre) if kind == "append" else 0
    x, *others = [pre + p for p in _prompts(4, [23, 26, 29, 24], seed=4, vocab=600)]  # one bucket

    def run(companions, x_slot):
        st = eng.init_decode_state()
        rows = [SlotPrefill(x, x_slot, 1, 1.0, start)]
        free = [s for s in range(4) if s != x_slot]
        rows += [SlotPrefill(o, free[i], 5 + i, 1.0, start) for i, o in enumerate(companions)]
        if start:  # the slots hold the shared prefix (an earlier turn's K/V)
            pref = eng.prefill_tokens(eng.params, pre + [x[start]], seed=1, temperature=1.0)
            for r in rows:
                st = eng.insert(pref, st, r.slot)
        st, _ = eng.prefill_slots(eng.params, st, rows[1:] + rows[:1])  # x last among the rows
        toks, lps = _decode(eng, st, steps=12)
        return toks[:, x_slot], lps[:, x_slot]

    want_t, want_l = run([], 0)
    for companions, slot in [(others[:1], 0), (others[:1], 1), (others, 2), (others, 3)]:
        got_t, got_l = run(companions, slot)
        np.testing.assert_array_equal(got_t, want_t)
        np.testing.assert_array_equal(got_l, want_l)


# ------------------------------------------------------------------ (7) the append-prefill reads a window


@pytest.mark.parametrize("per_layer", [True, False], ids=["per_layer_cache", "stacked_cache"])
def test_windowed_append_prefill_equals_the_whole_cache_path(model, per_layer):
    """An append-prefill reads, attends to and writes back only the bucket W of each row's end
    position (``window``), not all ``max_cache_len`` positions: the same K/V (fp32, 1e-5), the
    same positions past W left untouched (bit-identical) and the same decode tokens and log-probs
    as the program over the whole cache (``window=None``, the path before); ``prefill_slots`` runs
    one program per (T, W) pair, each row in its own W."""
    S_ = 256
    eng = Qwen3Engine(model.config, nnx.state(model, nnx.Param), slots=4, max_cache_len=S_, dtype="float32",
                      kv_per_layer=per_layer, kv_layout="contiguous")
    held = _prompts(3, [20, 40, 70], seed=5)  # cached contexts (earlier turns) in slots 0..2
    new = _prompts(3, [6, 9, 12], seed=6)  # the next turn's tokens (the last one stays pending)
    rows = [SlotPrefill(h + n, i, 30 + i, 1.0, start=len(h)) for i, (h, n) in enumerate(zip(held, new))]

    def armed():
        st = eng.init_decode_state()
        for i, h in enumerate(held):
            st = eng.insert(eng.prefill_tokens(eng.params, h + [new[i][0]], seed=1, temperature=1.0), st, i)
        return jax.tree.map(lambda x: x + 0 if isinstance(x, jax.Array) else x, st)  # fresh buffers

    windows: list = []
    prog = eng._jits["append_prefill"]

    def spy(*a, **k):
        windows.append(k.get("window"))
        return prog(*a, **k)

    eng._jits["append_prefill"] = spy
    try:
        st_w, res = eng.prefill_slots(eng.params, armed(), rows)
    finally:
        eng._jits["append_prefill"] = prog
    assert sorted(windows) == [32, 64, 128]  # each row's own window: 25, 48, 81 end positions
    assert [r.prefill_tokens for r in res] == [len(n) - 1 for n in new]
    # the reference: every row through the whole-cache program, one call (B rows, as before)
    B = 4
    T = 16
    buf, starts, lens = np.zeros((B, T), np.int32), np.zeros((B,), np.int32), np.zeros((B,), np.int32)
    slots, pend = np.full((B,), B, np.int32), np.zeros((B,), np.int32)
    seeds, temps = np.zeros((B,), np.uint32), np.ones((B,), np.float32)
    for j, r in enumerate(rows):
        toks = r.tokens[r.start:-1]
        buf[j, :len(toks)], starts[j], lens[j], slots[j], pend[j], seeds[j] = toks, r.start, len(toks), j, r.tokens[-1], r.seed
    st_f, _ = eng.programs["append_prefill"](eng.params, armed(), *map(jnp.asarray, (buf, starts, lens, slots, pend,
                                                                                      seeds, temps)))
    ck_w, ck_f = st_w["cache"], st_f["cache"]
    np.testing.assert_array_equal(np.asarray(ck_w.lengths), np.asarray(ck_f.lengths))
    for a, b in zip(jax.tree.leaves((ck_w.k, ck_w.v)), jax.tree.leaves((ck_f.k, ck_f.v))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)
    # past each row's window its cache row is bit-identical to the armed state's (untouched)
    before = armed()["cache"]
    for i, W in enumerate([32, 64, 128]):
        for a, b in zip(jax.tree.leaves((ck_w.k, ck_w.v)), jax.tree.leaves((before.k, before.v))):
            a, b = np.asarray(a), np.asarray(b)
            if per_layer and a.shape[-1] == S_:  # a layer's key-transposed k [B,K,H,S]
                np.testing.assert_array_equal(a[i, ..., W:], b[i, ..., W:])
            else:  # v [B,K,S,H] per layer, or stacked [L,B,K,S,H]
                sl = (i, slice(None), slice(W, None)) if per_layer else (slice(None), i, slice(None), slice(W, None))
                np.testing.assert_array_equal(a[sl], b[sl])
    got_t, got_l = _decode(eng, st_w)
    want_t, want_l = _decode(eng, st_f)
    np.testing.assert_array_equal(got_t, want_t)
    np.testing.assert_allclose(got_l, want_l, rtol=0, atol=1e-5)
