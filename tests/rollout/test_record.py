"""One record from the generator to the learner batch: a behaviour log-prob keeps its name
(``behav_logp``), its dtype (float32 arrays, never Python float lists) and its bits from the
:class:`rollout.types.Completion` through the agent's :class:`rollout.types.Trajectory` and the buffer
to :func:`jax_rl.learner.batch.learner_batch` and :func:`jax_rl.learner.batch.validate_batch`, NaN / -inf /
subnormal included: values are checked once, where the batch is built, and the loss masks and counts
non-finite ones (``masked_nonfinite_behav``, tests/losses)."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np

from jax_rl.learner.batch import learner_batch, validate_batch
from jax_rl.config import CONFIG_DIR, load_config
from rollout.agent import AgentLoop
from rollout.buffer import TrajectoryBuffer
from rollout.envs import make_env
from rollout.types import Completion, Trajectory
from tests.rollout.test_agent import CFG, TOK, ScriptedGenerator, reference_script

# float32 values whose bits a float64 round trip or a JSON list could change or that must not raise
SPECIAL = np.array([-np.inf, np.nan, -1e-45, -0.0, -3.2500002, np.float32(-1) / 3], np.float32)


class SpecialGenerator(ScriptedGenerator):
    """The scripted model, with behaviour log-probs cycling through :data:`SPECIAL` (arrays, as the
    generator hands them) and version 5 on every token."""

    def submit(self, prompt_ids, *, max_new_tokens, seed, stop_ids):
        c = super().submit(prompt_ids, max_new_tokens=max_new_tokens, seed=seed, stop_ids=stop_ids).result()
        n = len(c.tokens)
        f: Future = Future()
        f.set_result(Completion(c.request_id, c.tokens, np.resize(SPECIAL, n), np.full(n, 5, np.int32),
                                c.finish_reason))
        return f


def _bits(a) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.int32)


def test_completion_holds_arrays():
    c = Completion(0, [4, 5, 6], [-0.5, -1.0, -np.inf], [2, 2, 3])
    assert c.behav_logp.dtype == np.float32 and c.versions.dtype == np.int32 and c.tokens == [4, 5, 6]
    arr = np.array([-1.0, -2.0], np.float32)
    assert np.shares_memory(Completion(1, [1, 2], arr, np.array([0, 0], np.int32)).behav_logp, arr)  # no copy


def test_behav_logp_bits_from_completion_to_learner_batch():
    gen = SpecialGenerator(reference_script("calculator"))
    loop = AgentLoop(gen, TOK, lambda: make_env("calculator"), CFG)
    try:
        trajs = [loop.run_episode(0, group_id=1, sample_idx=i) for i in range(2)]
    finally:
        loop.close()
    for t in trajs:
        assert isinstance(t, Trajectory) and not t.failed and t.info["turns"] >= 2, t.info
        assert t.behav_logp.dtype == np.float32 and t.versions.dtype == np.int32
        want = np.concatenate([np.resize(SPECIAL, n) for n in _turn_lengths(t)])  # each turn's completion
        np.testing.assert_array_equal(_bits(t.behav_logp[t.loss_mask]), _bits(want))
        assert (t.versions[t.loss_mask] == 5).all() and (t.versions[~t.loss_mask] == -1).all()
        assert (_bits(t.behav_logp[~t.loss_mask]) == 0).all()
    buf = TrajectoryBuffer(group_size=2, max_staleness=1)
    assert buf.admit(5)
    buf.put_group(trajs)
    groups = buf.get_batch(1, 5, timeout=0)
    cfg = load_config(CONFIG_DIR / "tiny_cpu.yaml", ["algo.group_size=2", "optim.batch_size=2", "optim.max_seq_len=4096"])
    _, rows, batch = learner_batch(cfg, groups, pad_id=TOK.pad_id)
    out = validate_batch(batch, max_seq_len=4096, current_version=5)  # NaN / -inf behav_logp: no error here
    for b, t in enumerate(rows):
        n = len(t)
        np.testing.assert_array_equal(_bits(out["behav_logp"][b, :n]), _bits(t.behav_logp))
        assert (_bits(out["behav_logp"][b, n:]) == 0).all() and not out["loss_mask"][b, n:].any()
    assert np.isnan(out["behav_logp"][out["loss_mask"]]).any() and np.isneginf(out["behav_logp"]).any()


def _turn_lengths(t: Trajectory) -> list[int]:
    """Lengths of the generated turns (runs of ``loss_mask``), in order."""
    m = np.concatenate([[False], t.loss_mask, [False]]).astype(np.int8)
    starts, ends = np.flatnonzero(np.diff(m) == 1), np.flatnonzero(np.diff(m) == -1)
    return (ends - starts).tolist()
