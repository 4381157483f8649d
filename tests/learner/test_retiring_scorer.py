"""``old_logits.route=interrupt`` / ``retire`` pieces (:class:`jax_rl.learner.correction.old_logits.RetiringScorer`):
a version's tokens in partial prefixes are scored with its params before they are dropped, the
finished trajectories then equal the snapshot route's old log-probs, retire drops theta_v only
after its last token is scored, at most 2 versions are ever held, a stash that does not match
the final tokens drops the trajectory (counted), and the rollout-side pieces the routes need
(``Generator.partial_tokens`` / ``paused`` / ``apply_update_now``, ``AgentLoop(track=True)``)."""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future

import jax
import numpy as np
import pytest

from jax_rl.config import load_config
from jax_rl.learner.correction.old_logits import OldLogitScorer, RetiringScorer, StaleVersionError, trajectory_key
from rollout.types import Completion, Trajectory

from ._util import make_cfg, trained_exact_learner
from .test_dedicated_scorer import _snapshot


@pytest.fixture(scope="module")
def trained():
    """``_util.trained_exact_learner()``: 3 steps, store versions 1..3, rows mixing versions."""
    return trained_exact_learner()


def _final(b) -> list[Trajectory]:
    out = []
    for i in range(b["tokens"].shape[0]):
        n = int(b["attention_mask"][i].sum())
        out.append(Trajectory(tokens=b["tokens"][i, :n], loss_mask=b["loss_mask"][i, :n],
                              behav_logp=b["behav_logp"][i, :n], versions=b["versions"][i, :n],
                              turn_ids=b["turn_ids"][i, :n], group_id=i // 4, reward=0.5, info={"sample_idx": i % 4}))
    return out


def _prefix_when_leaving(t: Trajectory, v: int):
    """What the rollout side holds of episode ``t`` the moment the fleet leaves version ``v``: its
    tokens up to its last token of version <= v (the prompt alone when it has none yet)."""
    gen = np.flatnonzero(t.loss_mask)
    upto = gen[t.versions[gen] <= v]
    n = int(upto[-1]) + 1 if upto.size else int(gen[0]) if gen.size else len(t)
    return trajectory_key(t), t.tokens[:n], t.versions[:n], t.loss_mask[:n]


class _FakeGen:
    """Records the pause and the swap (``update_params`` / ``apply_update_now`` / ``paused``)."""

    def __init__(self):
        self.paused_now = False
        self.version = None
        self.pending = None
        self.events = []

    def update_params(self, params, version):
        self.pending = version
        return 0.0

    def apply_update_now(self):
        self.version, self.pending = self.pending, None
        self.events.append(("swap", self.version))

    @contextlib.contextmanager
    def paused(self):
        self.paused_now = True
        self.events.append(("pause",))
        try:
            yield
        finally:
            self.paused_now = False
            self.events.append(("resume",))


def _params(lrn, v):
    return lrn.old_logits.store.get(v, lrn.param_shardings) if v != lrn.version else jax.tree.map(lambda x: x.copy(),
                                                                                        lrn.state.params)


def test_interrupt_scores_partial_prefixes_before_dropping(trained, devices):
    """The fleet goes 1 -> 2 -> 3 under route=interrupt. At each publish the generators are paused,
    the outgoing version's tokens in the partial prefixes (and finished episodes) are scored while
    its params are still held, then they are dropped; the finished trajectories' old log-probs
    (stash + the fleet's version) equal the snapshot route's on every loss token."""
    lrn, b = trained
    trajs = _final(b)
    sc = OldLogitScorer(lrn.old_logits.logprob_fn(), lrn.param_shardings, lrn.mesh, keep=2, max_seq_len=32)
    sc.put(1, _params(lrn, 1), copy=False)
    gens = [_FakeGen(), _FakeGen()]
    leaving = {"v": None}
    calls = []

    def sources():
        v = leaving["v"]
        calls.append((v, sc.versions, all(g.paused_now for g in gens)))
        return [_prefix_when_leaving(t, v) for t in trajs]

    released = []
    rs = RetiringScorer(sc, sources, released.extend, pause=True, rows_per_forward=3)
    for v in (2, 3):
        leaving["v"] = v - 1
        rs.publish(v, _params(lrn, v), gens)
        assert sc.versions == [v]  # the outgoing params are gone once the publish returns
        assert all(g.version == v and g.events[-3:] == [("pause",), ("swap", v), ("resume",)] for g in gens)
    # each retire captured while the generators were paused and its version was still held
    assert calls == [(1, [1, 2], True), (2, [2, 3], True)]
    assert rs.retired == 2 and rs.retire_rows == 2 + 3  # v1: rows 1, 5; v2: rows 0, 2, 5
    assert rs.max_held == 2 and rs.stall_s > 0
    want = _snapshot(lrn, b)
    got = np.zeros_like(want)
    for g in (trajs[:4], trajs[4:]):
        kept, dropped = rs.score_group(g)
        assert kept == g and dropped == []
    for i, t in enumerate(trajs):
        got[i, : len(t)] = t.old_logp
    lm = b["loss_mask"]
    diff = np.abs(got - want)[lm].max()
    assert diff <= 1e-6, diff  # other input shapes than the snapshot's batch: see test_old_logits_routes
    assert sorted(released) == sorted(trajectory_key(t) for t in trajs) and rs.stats()["old_logits_stashed"] == 0
    assert sc.scored == 8 and sc.dropped == 0 and rs.stash_mismatch == 0
    assert rs.retire_partial == 2  # row 5's v1 part and row 0's v2 part came from partial prefixes


def test_retire_drops_params_only_after_last_token(trained, devices):
    """route=retire: the publish returns with the fleet already at v+1 and theta_v still held; the
    background retire scores v's tokens (a group finishing meanwhile waits, then reads the stash)
    and only then drops theta_v."""
    lrn, b = trained
    trajs = _final(b)
    sc = OldLogitScorer(lrn.old_logits.logprob_fn(), lrn.param_shardings, lrn.mesh, keep=2, max_seq_len=32)
    sc.put(2, _params(lrn, 2), copy=False)
    go, inside = threading.Event(), threading.Event()
    seen = []

    def sources():
        inside.set()
        assert go.wait(30)
        seen.append(sc.versions)
        return [_prefix_when_leaving(t, 2) for t in trajs if 1 not in t.versions]

    gens = [_FakeGen()]
    rs = RetiringScorer(sc, sources, pause=False)
    rs.publish(3, _params(lrn, 3), gens)
    assert gens[0].version == 3 and gens[0].events == [("swap", 3)]  # no pause: generating at 3 at once
    assert inside.wait(30)
    assert sc.versions == [2, 3]  # retire of 2 in progress: theta_2 still held
    result = {}
    t = threading.Thread(target=lambda: result.update(out=rs.score_group(trajs[:1])))
    t.start()  # row 0 (2 then 3) finishes now: waits for the retire (one lock)
    t.join(0.2)
    assert t.is_alive() and trajs[0].old_logp is None
    go.set()
    rs.wait_retired(30)
    t.join(30)
    assert seen == [[2, 3]] and sc.versions == [3] and rs.retired == 1
    kept, dropped = result["out"]
    assert kept == trajs[:1] and not dropped
    want = _snapshot(lrn, b)
    lm0 = b["loss_mask"][0]
    assert np.abs(trajs[0].old_logp - want[0, : len(trajs[0])])[lm0[: len(trajs[0])]].max() <= 1e-6
    rs.stop()


def test_at_most_two_versions_held_whatever_k(trained, devices):
    """Publishes back to back faster than the retires: each publish waits for the previous retire
    (the learner waits; never the rollouts), so the scorer never holds more than 2 versions."""
    lrn, b = trained
    trajs = _final(b)
    sc = OldLogitScorer(lrn.old_logits.logprob_fn(), lrn.param_shardings, lrn.mesh, keep=2, max_seq_len=32)
    held_seen = []
    retired_at_put = []
    orig_put = sc.put

    def put(version, params, copy=True):
        held_seen.append(len(sc) + 1)
        retired_at_put.append((version, rs.retired if version > 1 else None))
        return orig_put(version, params, copy=copy)

    sc.put = put
    rs = None
    sc.put(1, _params(lrn, 1), copy=False)
    gate = threading.Semaphore(0)

    def sources():
        held_seen.append(len(sc))
        gate.acquire(timeout=30)
        return [_prefix_when_leaving(t, 1) for t in trajs]

    rs = RetiringScorer(sc, sources, pause=False)
    params = _params(lrn, 1)
    for v in range(2, 6):  # every retire holds until released; the next publish must wait for it
        threading.Timer(0.1, gate.release).start()
        rs.publish(v, params, [_FakeGen()])
        assert len(sc) <= 2
    gate.release()
    rs.wait_retired(30)
    assert max(held_seen) <= 2 and rs.max_held == 2 and rs.retired == 4 and sc.versions == [5]
    # each put found the previous version's retire finished: the publish waited for it
    assert retired_at_put == [(1, None), (2, 0), (3, 1), (4, 2), (5, 3)]
    rs.stop()
    with pytest.raises(ValueError, match="holds 2 versions"):
        RetiringScorer(OldLogitScorer(lrn.old_logits.logprob_fn(), lrn.param_shardings, lrn.mesh, keep=1, max_seq_len=32),
                       list)


def test_mismatched_or_missing_version_is_dropped_and_counted(trained, devices):
    """A stash whose prefix is not the final trajectory's is never used (dropped, counted); a
    version neither stashed nor held drops its trajectory; a retire of a version that is gone
    while tokens of it wait says so."""
    lrn, b = trained
    trajs = _final(b)
    sc = OldLogitScorer(lrn.old_logits.logprob_fn(), lrn.param_shardings, lrn.mesh, keep=2, max_seq_len=32)
    sc.put(2, _params(lrn, 2), copy=False)
    key, tok, ver, lm = _prefix_when_leaving(trajs[2], 2)
    tok = tok.copy()
    tok[0] += 1  # a prefix that is not the trajectory's
    rs = RetiringScorer(sc, lambda: [(key, tok, ver, lm)])
    rs.retire(2)
    kept, dropped = rs.score_group([trajs[2], trajs[1]])  # row 1: version 1, neither stashed nor held
    assert kept == [] and dropped == [trajs[2], trajs[1]] and rs.stash_mismatch == 1 and sc.dropped == 2
    assert trajs[2].old_logp is None and trajs[1].old_logp is None
    with pytest.raises(StaleVersionError, match="retire of version 1"):
        RetiringScorer(sc, lambda: [_prefix_when_leaving(trajs[1], 1)]).retire(1)


# --------------------------------------------------------------------------- rollout side


def test_generator_partial_pause_and_swap_now():
    """``partial_tokens`` ships a slot's tokens and versions so far; ``apply_update_now`` swaps before it
    returns; ``paused`` keeps any step from running."""
    from flax import nnx

    from jax_rl.models import qwen3 as q
    from rollout.engine import Qwen3Engine
    from rollout.generator import Generator

    model = q.Qwen3ForCausalLM(q.get_preset("tiny_dense"), rngs=nnx.Rngs(0))
    p1 = nnx.state(model, nnx.Param)
    eng = Qwen3Engine(model.config, p1, slots=2, max_cache_len=64, dtype="float32", temperature=1.0, kv_layout="contiguous")
    gen = Generator(eng, partial="continue", version=0)
    fa = gen.submit([5, 6, 7], max_new_tokens=10, seed=1)
    for _ in range(3):
        gen.step()
    toks, vers, rts = gen.partial_tokens(fa.request_id)
    assert len(toks) == 3 and vers == [0, 0, 0] and rts is None  # a dense engine records no routes
    assert gen.partial_tokens(12345) is None
    gen.update_params(p1, 1)
    gen.apply_update_now()
    assert gen.version == 1
    with gen.paused():
        t = threading.Thread(target=gen.step)
        t.start()
        t.join(0.3)
        assert t.is_alive()  # blocked by the pause
        assert gen.partial_tokens(fa.request_id)[1] == [0, 0, 0]  # callable inside the pause
    t.join(30)
    gen.run_until_idle()
    comp = fa.result(timeout=0)
    assert comp.versions.tolist() == [0, 0, 0] + [1] * 7 and comp.tokens[:3] == toks


class _PendingGen:
    """``submit`` returns a pending Future; ``partial_tokens`` reports ``live`` tokens for it."""

    def __init__(self):
        self.futs = []
        self.live = {}

    def submit(self, prompt_ids, *, max_new_tokens, seed, stop_ids):
        f = Future()
        f.request_id = len(self.futs)
        self.futs.append(f)
        return f

    def partial_tokens(self, rid):
        return self.live.get(rid)


def test_agent_tracks_partial_and_finished_episodes():
    """``AgentLoop(track=True)`` ships an in-flight episode's prefix with the generator slot's
    tokens and versions, then the finished trajectory, until released."""
    from jax_rl.config import RolloutConfig
    from jax_rl.models.tokenizer import compact_tokenizer
    from rollout.agent import AgentLoop
    from rollout.envs import CalculatorEnv

    tok = compact_tokenizer()
    cfg = RolloutConfig(max_turns=1, max_new_tokens_per_turn=8, max_tokens_per_episode=8, max_cache_len=4096,
                        episode_timeout_s=30.0, slots=1)
    gen = _PendingGen()
    agent = AgentLoop(gen, tok, CalculatorEnv, cfg, track=True)
    fut = agent.submit_episode(7, group_id=3, sample_idx=0)
    for _ in range(200):
        if gen.futs:
            break
        threading.Event().wait(0.01)
    for _ in range(200):
        if agent._live[(3, 0)]["fut"] is not None:
            break
        threading.Event().wait(0.01)
    (key, t0, v0, m0, r0), = agent.unscored_prefixes()
    assert key == (3, 0) and not m0.any() and (v0 == -1).all() and r0 is None  # the prompt only
    gen.live[0] = ([11, 12], [4, 4])
    (_, t1, v1, m1, _), = agent.unscored_prefixes()
    assert t1.tolist() == t0.tolist() + [11, 12] and v1[-2:].tolist() == [4, 4] and m1[-2:].all()
    gen.live.clear()
    gen.futs[0].set_result(Completion(0, [11, 12, 13], [-1.0] * 3, [4, 4, 5], "length"))
    traj = fut.result(timeout=30)
    (_, t2, v2, m2, _), = agent.unscored_prefixes()
    np.testing.assert_array_equal(t2, traj.tokens)
    assert v2[-3:].tolist() == [4, 4, 5] and trajectory_key(traj) == (3, 0)
    agent.release([(3, 0)])
    assert agent.unscored_prefixes() == []
    agent.close()
    untracked = AgentLoop(gen, tok, CalculatorEnv, cfg)
    assert untracked.unscored_prefixes() == []
    untracked.close()


def test_agent_prefix_routes_align_with_the_trajectory():
    """A recording generator (``partial_tokens`` ships routes over prompt + tokens so far): the
    in-flight prefix's routes are aligned with its tokens and equal, at every position already
    run, the routes the finished trajectory carries there; the slot's last token (not fed yet)
    has none."""
    from jax_rl.config import RolloutConfig
    from jax_rl.models.tokenizer import compact_tokenizer
    from rollout.agent import AgentLoop
    from rollout.envs import CalculatorEnv
    from rollout.types import ROUTE_MISSING

    tok = compact_tokenizer()
    cfg = RolloutConfig(max_turns=1, max_new_tokens_per_turn=8, max_tokens_per_episode=8, max_cache_len=4096,
                        episode_timeout_s=30.0, slots=1)
    gen = _PendingGen()
    agent = AgentLoop(gen, tok, CalculatorEnv, cfg, track=True)
    fut = agent.submit_episode(7, group_id=1, sample_idx=0)
    for _ in range(400):
        if gen.futs and agent._live[(1, 0)]["fut"] is not None:
            break
        threading.Event().wait(0.01)
    (_, t0, _, _, r0), = agent.unscored_prefixes()
    assert r0 is None  # nothing recorded yet
    P = len(t0)
    rng = np.random.default_rng(0)
    full = rng.integers(0, 4, (P + 3, 2, 2)).astype(np.int8)  # the routes the turn's completion will carry
    full[-1] = ROUTE_MISSING
    part = full[: P + 2].copy()
    part[-1] = ROUTE_MISSING  # two tokens so far: the second not fed yet
    gen.live[0] = ([11, 12], [4, 4], part)
    (_, t1, _, _, r1), = agent.unscored_prefixes()
    assert r1.shape == (len(t1), 2, 2) and r1.dtype == np.int8
    np.testing.assert_array_equal(r1, part)
    gen.live.clear()
    gen.futs[0].set_result(Completion(0, [11, 12, 13], [-1.0] * 3, [4, 4, 5], "length", routes=full))
    traj = fut.result(timeout=30)
    np.testing.assert_array_equal(traj.routes[: P + 1], r1[: P + 1])  # every position the prefix had run
    (_, t2, _, _, r2), = agent.unscored_prefixes()
    np.testing.assert_array_equal(r2, traj.routes)
    agent.close()


def test_retire_refuses_prefixes_without_routes_under_r3():
    """A scorer that forces routes (r3) refuses a chunk mixing prefixes with and without routes
    and routes not aligned with their tokens, instead of routing some rows by the router."""
    sc = OldLogitScorer(lambda p, t, a: None, None, None, keep=2, max_seq_len=32)
    sc.routes_fn = lambda p, t, a, r: None
    rs = RetiringScorer(sc, lambda: [])
    row = lambda k, n, r: (k, np.arange(n), np.zeros(n, np.int32), np.ones(n, bool), r)  # noqa: E731
    with pytest.raises(ValueError, match="carry no routes"):
        rs._pad([row(0, 4, np.zeros((4, 2, 2), np.int8)), row(1, 4, None)])
    with pytest.raises(ValueError, match="3 positions"):
        rs._pad([row(0, 4, np.zeros((3, 2, 2), np.int8))])
    rts = rs._pad([row(0, 4, np.ones((4, 2, 2), np.int8))])[4]  # T: the smallest seq bucket holding 4 (16)
    assert rts.shape == (1, 16, 2, 2) and rts.dtype == np.int8 and (rts[0, :4] == 1).all() and (rts[0, 4:] == -1).all()
    sc.routes_fn = None  # not r3: routes are not forced, so not required
    assert rs._pad([row(0, 4, np.zeros((4, 2, 2), np.int8)), row(1, 4, None)])[4] is None


def test_config_accepts_new_routes_and_refuses_ray():
    from jax_rl.config import ConfigError
    from jax_rl.learner.correction import check_config

    for route in ("interrupt", "retire"):
        cfg = check_config(load_config(None, ["loss.correction=exact", f"old_logits.route={route}"]))
        assert cfg.old_logits.route == route
        with pytest.raises(ConfigError, match=f"old_logits.route={route} is implemented for runtime=embedded only"):
            check_config(load_config(None, ["loss.correction=exact", f"old_logits.route={route}", "runtime=ray"]))
        with pytest.raises(ConfigError, match="serves loss.correction=exact only"):
            check_config(load_config(None, [f"old_logits.route={route}"]))
    lrn_cfg = make_cfg("exact", **{"async": {"max_staleness": 2}}, old_logits={"route": "retire"})
    from jax_rl.learner.correction import make_correction
    from jax_rl.learner.correction.old_logits.routes import Retire

    s = make_correction(lrn_cfg)
    assert isinstance(s.route, Retire) and s.route.track_unscored and s.route.scorer_keep() == 2
    assert s.scores_before_buffer and not s.learner_store and "1 or 2 whatever K" in s.describe()
