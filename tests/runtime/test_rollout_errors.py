"""Bad episodes in the embedded runtime (issue 16 items 4 and 6), through RolloutManager with a
scripted generator (no model), and the start-of-run preflight through the CLI."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from jax_rl.config import CONFIG_DIR, load_config
from jax_rl.runtime.envs import build_env_factory, rollout_preflight
from jax_rl.runtime.embedded import RolloutManager
from rollout.agent import AgentLoop
from rollout.buffer import TrajectoryBuffer
from rollout.envs import CalculatorEnv
from tests.rollout.test_agent import TOK, ScriptedGenerator, reference_script

TINY_CFG = CONFIG_DIR / "tiny_cpu.yaml"


class InfLatencyEnv(CalculatorEnv):
    """A tool whose latency is ``inf`` for some tasks: ``time.sleep(inf)`` raises OverflowError."""

    bad = staticmethod(lambda seed: True)

    def _sleep(self):
        if self.bad(self.seed):
            time.sleep(float("inf"))


def _manager(bad, limit=6):
    cfg = load_config(TINY_CFG, ["model.tokenizer=compact", "rollout.max_cache_len=1024", "optim.max_seq_len=1024",
                                 "algo.group_size=2", "optim.batch_size=4", "rollout.slots=2",
                                 "rollout.max_new_tokens_per_turn=200", "rollout.max_tokens_per_episode=400",
                                 "async.max_staleness=0", f"rollout.max_consecutive_episode_errors={limit}"])
    env_cls = type("Env", (InfLatencyEnv,), {"bad": staticmethod(bad)})
    gen = ScriptedGenerator(reference_script("calculator"))
    agent = AgentLoop(gen, TOK, env_cls, cfg.rollout, max_workers=4)
    buf = TrajectoryBuffer(2, 0, groups_per_step=2, max_seq_len=cfg.optim.max_seq_len)
    version = [0]
    return RolloutManager(cfg, [], [agent], buf, lambda: version[0]), buf, version


def test_one_bad_tool_fails_its_episode_only_and_the_rollout_goes_on():
    mgr, buf, version = _manager(lambda seed: seed % 3 == 0)  # tasks 0, 3, 6, ...: both samples fail
    mgr.start()
    try:
        got = []
        for _ in range(3):
            batch = buf.get_batch(2, version[0], timeout=30)
            assert batch is not None, (mgr.fatal, mgr.errors, buf.stats())
            got += [g[0].seed for g in batch]
            version[0] += 1  # a learner step: frees admission capacity
            buf.notify()
        assert all(s % 3 for s in got) and mgr.fatal is None
    finally:
        mgr.stop(timeout=5)
    s = buf.stats()
    assert s["failed"] >= 2 and s["failed_groups"] >= 1 and mgr.episode_errors == s["failed"]
    assert s["produced"] == s["consumed"] + s["dropped_stale"] + s["pending"]
    assert mgr.state()["episode_errors"] == mgr.episode_errors  # checkpointed with the producer state


def test_a_systematically_failing_rollout_stops_with_the_reason():
    mgr, buf, _ = _manager(lambda seed: True, limit=6)
    mgr.start()
    try:
        t = time.monotonic()
        while mgr.fatal is None and time.monotonic() - t < 60:
            assert buf.get_batch(2, 0, timeout=0.2) is None
    finally:
        mgr.stop(timeout=5)
    assert mgr.fatal is not None, "an always-failing rollout must stop the run, not spin"
    assert "OverflowError" in mgr.fatal and "rollout.max_consecutive_episode_errors=6" in mgr.fatal
    s = buf.stats()
    assert s["in_flight_groups"] == 0 and s["admitted_groups"] == s["failed_groups"] + s["cancelled_groups"]


def test_rollout_idle_frac_counts_the_time_blocked_by_the_staleness_bound():
    # K=0, 2 groups per step, the learner never consumes: after 2 groups every producer thread
    # waits in admit (back-pressure), which rollout_idle_frac counts; nothing else does.
    mgr, buf, _ = _manager(lambda seed: False)
    assert mgr.rollout_idle_frac() == 0.0  # not started: no threads, no time
    mgr.start()
    try:
        t = time.monotonic()
        while buf.stats()["pending_groups"] < 2 and time.monotonic() - t < 60:
            time.sleep(0.05)
        waited0 = mgr.admit_wait_s
        time.sleep(0.5)  # every thread is blocked now: admit_wait_s grows by ~n_threads x this
        waited1 = mgr.admit_wait_s
    finally:
        mgr.stop(timeout=5)
    s = buf.stats()
    assert s["admitted_groups"] == 2 and s["pending_groups"] == 2, s  # the bound held the rollout back
    assert waited1 > waited0
    assert 0.0 < mgr.rollout_idle_frac() <= 1.0


def test_preflight_warns_once_for_overlong_prompts_not_for_top_p(caplog):
    # top_p / top_k no longer warn: the learner reproduces the sampler's truncation (issue 14 item 7)
    cfg = load_config(TINY_CFG, ["model.tokenizer=compact", "rollout.max_cache_len=160", "optim.max_seq_len=160",
                                 "rollout.top_p=0.9", "rollout.top_k=20"])
    with caplog.at_level(logging.WARNING, logger="jax_rl.runtime"):
        ws = rollout_preflight(cfg, TOK, build_env_factory(cfg))
    assert len(ws) == 1 and len(caplog.records) == 1
    assert "do not fit rollout.max_cache_len=160" in ws[0] and "dropped_overlong" in ws[0]
    assert not any("top_p" in w or "top_k" in w for w in ws)


def test_cli_prompts_that_never_fit_end_at_start_naming_the_key(tmp_path, capsys):
    # issue 16 item 4's command: it died at RL step 1 with BatchError (162 tokens > max_seq_len=128)
    from jax_rl.cli import main

    d = tmp_path / "r"
    assert main(["train", str(TINY_CFG), "model.tokenizer=compact", "sft.steps=0", "run.steps=2",
                 f"run.dir={d}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "rollout.max_cache_len=128" in err and "every sampled prompt is too long" in err
    assert not d.exists()


def test_every_lost_episode_is_logged_rate_limited_and_counted_by_reason(caplog):
    """Issue 48 item 3: each lost episode is one warning line naming its kind and reason (the first few,
    then a count every N), and the counts by kind reach the producer state (checkpointed: a resume goes on
    counting) and the row / summary columns (``episode_failures_by_reason``)."""
    from jax_rl.runtime.loop import EpisodeGuard, buffer_columns
    from rollout.types import Trajectory

    def traj(seed, **info):
        n = 12 if info.pop("long", False) else 4
        return Trajectory(tokens=np.zeros(n, np.int32), loss_mask=np.ones(n, bool), behav_logp=np.zeros(n, np.float32),
                          versions=np.zeros(n, np.int32), turn_ids=np.zeros(n, np.int32), reward=0.0, group_id=seed,
                          env="calculator", seed=seed, info=info)

    g = EpisodeGuard(0, by_reason={"failed:KeyError": 2}, max_seq_len=8, log_first=3, log_every=4)
    with caplog.at_level(logging.WARNING, logger="jax_rl.runtime"):
        g.record([traj(1, failed=True, fail_reason="OverflowError: cannot convert float infinity to integer"),
                  traj(1), traj(2, overlong="prompt"), traj(3, long=True)])
        g.record_error(2, "group 7: RuntimeError('generator gone\\nline two')")
        g.record_error(3, "put group 8: ValueError('mixed group ids')", kind="put_error")
    assert g.by_reason == {"failed:KeyError": 2, "failed:OverflowError": 1, "prompt_overlong": 1,
                           "over_max_seq_len": 1, "group_error:RuntimeError": 2, "put_error:ValueError": 3}
    assert g.episode_errors == 1 + 2 + 3
    lines = [r.getMessage() for r in caplog.records if r.name == "jax_rl.runtime"]
    assert all("\n" not in ln for ln in lines), lines
    lost = [ln for ln in lines if ln.startswith("episode lost (")]
    assert len(lost) == 3  # the first log_first, one line each
    assert "failed:OverflowError" in lost[0] and "group 1, seed 1" in lost[0] and "cannot convert" in lost[0]
    assert "prompt_overlong" in lost[1] and "over_max_seq_len" in lost[2] and "12 tokens > optim.max_seq_len=8" in lost[2]
    summed = [ln for ln in lines if ln.startswith("episodes lost so far")]
    assert len(summed) == 2 and "8" in summed[-1] and "'put_error:ValueError': 3" in summed[-1], summed  # 4th, 8th
    row = buffer_columns({"dropped_overlong": 1}, g.episode_errors, row=True, by_reason=g.by_reason)
    assert row["episode_failures_by_reason"]["put_error:ValueError"] == 3
    from jax_rl.metrics import sanitize

    assert sanitize(row)[0]["episode_failures_by_reason/prompt_overlong"] == 1  # metrics.jsonl's flat columns


def test_lost_episodes_reach_the_producer_state_by_reason(caplog):
    mgr, buf, version = _manager(lambda seed: seed % 3 == 0)
    with caplog.at_level(logging.WARNING, logger="jax_rl.runtime"):
        mgr.start()
        try:
            for _ in range(2):
                assert buf.get_batch(2, version[0], timeout=30) is not None, (mgr.fatal, buf.stats())
                version[0] += 1
                buf.notify()
        finally:
            mgr.stop(timeout=5)
    st = mgr.state()
    assert st["episode_failures_by_reason"] == {"failed:OverflowError": mgr.episode_errors} and mgr.episode_errors >= 2
    assert any(r.getMessage().startswith("episode lost (failed:OverflowError): env calculator") for r in caplog.records)


@pytest.mark.slow  # ~40 s: a real tiny train run
@pytest.mark.timeout(900)
def test_train_run_keeps_the_reasons_of_lost_episodes_in_summary_and_metrics(tmp_path, monkeypatch):
    """A real ``train`` whose env raises at reset for some training tasks (rollout threads only: the
    preflight, SFT demos and eval run elsewhere or on held-out seeds): summary.json and metrics.jsonl carry
    ``episode_failures_by_reason``, equal to ``episode_errors``."""
    import dataclasses
    import json
    import threading
    from pathlib import Path

    import rollout.envs as E
    from jax_rl.metrics import read_jsonl
    from jax_rl.runtime.train import run_train
    from tests.runtime.test_train import _cfg

    class Flaky(CalculatorEnv):
        def reset(self, seed):
            if threading.current_thread() is not threading.main_thread() and seed < 10**6 and seed % 3 == 0:
                raise KeyError(f"task {seed} is missing")
            return super().reset(seed)

    monkeypatch.setitem(E.ENVS, "calculator", dataclasses.replace(E.ENVS["calculator"], make=Flaky))  # its EnvSpec
    cfg = _cfg(tmp_path, "run.steps=2", "sft.steps=0")
    assert cfg.eval.seed_offset >= 10**6
    assert run_train(cfg) == 0
    d = Path(cfg.run.dir)
    summary = json.loads((d / "summary.json").read_text())
    assert summary["episode_errors"] > 0
    assert summary["episode_failures_by_reason"] == {"failed:KeyError": summary["episode_errors"]}
    last = read_jsonl(d / "metrics.jsonl")[-1]
    assert last["episode_failures_by_reason/failed:KeyError"] == last["episode_errors"] > 0
