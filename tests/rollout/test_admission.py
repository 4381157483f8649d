"""Deterministic admission (issue 48 item 5, ``rollout.admission``): a GRPO group's first requests are
admitted together (one prefill, copied into each sample's slot) however their threads are timed, and a
step admits by (group, sample, turn), so prefill counters are reproducible."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import numpy as np
import pytest
from flax import nnx

from rollout.admission import GangRoom, admission_sorted, gang_fits
from rollout.engine import Qwen3Engine
from rollout.generator import Generator
from rollout.types import Completion

S = 64


@pytest.fixture(scope="module")
def engine(model):
    return Qwen3Engine(model.config, nnx.state(model, nnx.Param), slots=4, max_cache_len=S, dtype="float32", kv_layout="contiguous")


class _R:
    def __init__(self, order=(), gang=None):
        self.order, self.gang, self.future = order, gang, Future()


def test_gang_room_releases_a_gang_whole_in_order_and_on_withdraw():
    room = GangRoom()
    a, b, c = _R((4, 1, 0), "g"), _R((4, 0, 0), "g"), _R((4, 2, 0), "g")
    assert room.add("g", 3, a) == [] and room.add("g", 3, b) == [] and len(room) == 2
    assert room.add("g", 3, c) == [b, a, c] and len(room) == 0  # released at once, by sample index
    assert room.withdraw("h", 2) == []  # a withdrawal before any member came
    d = _R((5, 1, 0), "h")
    assert room.add("h", 2, d) == [d]
    e = _R((6, 0, 0), "k")
    room.add("k", 2, e)
    assert room.drain() == [e] and len(room) == 0


def test_admission_order_is_by_key_then_arrival():
    x, y, z, u, v = _R((9, 0, 1)), _R((2, 1, 0)), _R(), _R((2, 0, 3)), _R()
    assert list(admission_sorted([x, y, z, u, v])) == [u, y, x, z, v]
    q = [_R((1, 0, 0), "g"), _R((1, 1, 0), "g"), _R((3, 0, 0))]
    assert gang_fits(q, q[0], 2, 4) and not gang_fits(q, q[0], 1, 4)
    assert gang_fits(q, q[2], 0, 4)  # no gang: always
    assert gang_fits(q, q[0], 1, 1)  # a gang larger than the engine goes piecewise


def _prompt(n=20, seed=0):
    return list(map(int, np.random.default_rng(seed).integers(1, 100, size=n)))


def test_a_group_split_over_two_steps_is_prefilled_once(engine):
    """The second sample of a group arrives a step late (thread timing). Without a gang its prompt is
    prefilled twice; as a gang it waits for its sibling and the pair is prefilled once."""
    p = _prompt()
    g = Generator(engine)
    g.submit(p, max_new_tokens=3, seed=1)
    g.step()
    g.submit(p, max_new_tokens=3, seed=2)
    g.run_until_idle()
    assert g.stats["prefill_tokens"] == 2 * (len(p) - 1) and g.stats["shared_prefills"] == 0  # the bug class

    g = Generator(engine)
    f0 = g.submit(p, max_new_tokens=3, seed=1, order=(7, 0, 0), gang=("grp7", 2))
    g.step()
    assert g.num_active == 0 and g.num_queued == 0 and not f0.done()  # waits for its sibling
    f1 = g.submit(p, max_new_tokens=3, seed=2, order=(7, 1, 0), gang=("grp7", 2))
    g.run_until_idle()
    assert g.stats["prefill_tokens"] == len(p) - 1 and g.stats["shared_prefills"] == 1
    a, b = f0.result(timeout=5), f1.result(timeout=5)
    assert b.info["shared_prefill"] and not a.info["shared_prefill"]  # sample 0 prefills, sample 1 copies


def test_withdrawn_member_and_order_and_stop(engine):
    p, q = _prompt(seed=1), _prompt(seed=2)
    g = Generator(engine)
    f = [g.submit(p, max_new_tokens=8, seed=s, order=(3, s, 0), gang=("g3", 3)) for s in (1, 0)]
    g.step()
    assert g.num_active == 0
    g.withdraw(("g3", 3))  # sample 2's episode ended before its first request
    late = g.submit(q, max_new_tokens=8, seed=9, order=(1, 0, 1))  # an older group's later turn, queued last
    g.step()
    assert [r.order for r in g.table.reqs if r is not None] == [(1, 0, 1), (3, 0, 0), (3, 1, 0)]  # slots in key order
    g.run_until_idle()
    assert all(x.result(timeout=5).finish_reason in ("length", "stop") for x in f + [late])
    # a generator stopped with a gang still waiting fails its requests (no caller left waiting)
    g = Generator(engine).start()
    w = g.submit(p, max_new_tokens=2, seed=0, order=(5, 0, 0), gang=("g5", 2))
    g.stop()
    with pytest.raises(RuntimeError, match="generator stopped"):
        w.result(timeout=5)


class _Recording:
    """A generator with the deterministic-admission interface; records each request's keys."""

    def __init__(self):
        self.calls, self.withdrawn, self.lock = [], [], threading.Lock()

    def submit(self, prompt_ids, *, max_new_tokens, seed, stop_ids, session=None, prefix_len=0, order=(), gang=None):
        from tests.rollout.test_agent import TOK

        with self.lock:
            self.calls.append((order, gang))
        f = Future()
        ids = TOK.encode("<answer>1</answer>") + [TOK.im_end_id]
        f.set_result(Completion(request_id=len(self.calls), tokens=ids, behav_logp=[0.0] * len(ids),
                                versions=[0] * len(ids), finish_reason="stop"))
        return f

    def withdraw(self, gang):
        with self.lock:
            self.withdrawn.append(gang)

    def release_session(self, session):
        pass


def test_agent_sends_order_and_gang_and_withdraws_an_episode_that_never_asked():
    from rollout.agent import AgentLoop
    from rollout.envs import CalculatorEnv
    from tests.rollout.test_agent import CFG, TOK

    made = []

    def factory():  # the group's second env fails at reset: that sample never submits
        made.append(1)
        env = CalculatorEnv()
        if len(made) == 2:
            env.reset = lambda seed: (_ for _ in ()).throw(KeyError("no such task"))
        return env

    gen = _Recording()
    loop = AgentLoop(gen, TOK, factory, CFG, max_workers=1)  # one worker: the samples run one after the other
    try:
        trajs = loop.submit_group(11, group_id=42, group_size=2).result(timeout=60)
    finally:
        loop.close()
    assert trajs[1].info["failed"] and not trajs[0].info["failed"]
    key = ((id(loop), 42), 2)
    assert gen.calls[0] == ((42, 0, 0), key)  # the first request: order key and its gang
    assert all(g is None and o[:2] == (42, 0) for o, g in gen.calls[1:])  # later turns: order only
    assert gen.withdrawn == [key]  # the failed sample let its sibling go


class _GangHolding(_Recording):
    """``_Recording`` that holds a gang's first requests until all its members asked (the real generator's
    admission), answering each in one turn."""

    def __init__(self):
        super().__init__()
        self.held: dict = {}

    def submit(self, prompt_ids, *, max_new_tokens, seed, stop_ids, session=None, prefix_len=0, order=(), gang=None):
        f = super().submit(prompt_ids, max_new_tokens=max_new_tokens, seed=seed, stop_ids=stop_ids, order=order)
        if gang is None:
            return f
        held = Future()
        with self.lock:
            members = self.held.setdefault(gang[0], [])
            members.append((held, f.result()))
            release = list(members) if len(members) == gang[1] else []
        for h, c in release:
            h.set_result(c)
        return held

    def release_all(self):
        with self.lock:
            for members in self.held.values():
                for h, c in members:
                    if not h.done():
                        h.set_result(c)


def test_two_threads_submitting_groups_at_once_do_not_starve_a_gang():
    """Two producer threads each submit a group of 2 to a loop of 2 workers (the embedded runtime's shape
    at ``rollout.slots=2``). Forced interleaving: group 0's thread waits after its first sample until group 1's
    thread has started (and for up to 2 s for group 1's first sample): interleaved (A0 B0 A1 B1), the two
    workers ran A0 and B0, each holding for a sibling queued behind the other, and neither group finished."""
    from rollout.agent import AgentLoop
    from rollout.envs import CalculatorEnv
    from tests.rollout.test_agent import CFG, TOK

    gen = _GangHolding()
    loop = AgentLoop(gen, TOK, CalculatorEnv, CFG, group_size=2, max_workers=2)
    b_started, b0_in = threading.Event(), threading.Event()
    real_submit = loop._pool.submit

    def submit(fn, *a, **kw):
        fut = real_submit(fn, *a, **kw)
        if kw["group_id"] == 1 and kw["sample_idx"] == 0:
            b0_in.set()
        if kw["group_id"] == 0 and kw["sample_idx"] == 0:
            assert b_started.wait(10)
            b0_in.wait(2.0)  # interleaved if group 1 can submit now; under the group lock it cannot
        return fut

    loop._pool.submit = submit
    out: dict = {}

    def group_b():
        b_started.set()
        out[1] = loop.submit_group(12, group_id=1)

    tb = threading.Thread(target=group_b)
    try:
        tb.start()
        out[0] = loop.submit_group(11, group_id=0)
        tb.join(10)
        done = [out[g].result(timeout=15) for g in (0, 1)]
    finally:
        gen.release_all()
        loop.close(wait=False)
    assert [len(x) for x in done] == [2, 2] and not any(t.info["failed"] for x in done for t in x)


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_a_gang_admitted_past_the_prefill_budget_prefills_as_without_it(model, layout):
    """Issue 62 item 5: which requests a step admits must not change the prefill work. A gang of 3 identical
    prompts arrives while a slot decodes; under a 1-token ``prefill_budget`` the first member is admitted
    (the first of a step always is) and its siblings cost nothing (copies of its K/V), so they must come
    with it, as under the default budget. They used to wait a step each (the budget check counted what
    the first one spent) and each re-ran the prompt's tail: its partial last page off the pool's published
    pages (paged), or the part after the prefix cache's ``prefix_len`` (contiguous: one more prefix hit each)."""
    eng = Qwen3Engine(model.config, nnx.state(model, nnx.Param), slots=4, max_cache_len=S, dtype="float32",
                      kv_layout=layout, **({"kv_page_size": 8} if layout == "paged" else {}))
    p, q = _prompt(20, seed=3), _prompt(6, seed=4)
    pre = 0 if layout == "paged" else 8  # the paged engine is its own prefix cache (rollout.prefix_cache 0)

    def run(budget):
        g = Generator(eng, prefill_budget=budget, prefix_cache=0 if layout == "paged" else 4)
        first = g.submit(q, max_new_tokens=12, seed=9)
        g.step()  # q decodes from now on
        futs = [g.submit(p, max_new_tokens=4, seed=s, order=(1, s, 0), gang=("g", 3), prefix_len=pre)
                for s in range(3)]
        g.run_until_idle()
        comps = [f.result(timeout=5) for f in [first] + futs]
        counts = {k: g.stats[k] for k in ("prefill_tokens", "prefills", "shared_prefills", "prefix_hits",
                                          "prefix_misses")}
        return counts, [c.info["prefill_tokens"] for c in comps], [c.info["prefix_hits"] for c in comps], \
            [c.tokens for c in comps]

    free, tight = run(None), run(1)
    assert free[0]["shared_prefills"] == 2 and free[0]["prefill_tokens"] == len(q) - 1 + len(p) - 1
    assert tight == free
