"""bench/e2e_rl.py's pure parts: per-step figures of a jax-rl run dir and the per-arm medians."""

from __future__ import annotations

import json

import pytest

from tests.bench_module import load_bench


@pytest.fixture(scope="module")
def e2e():
    return load_bench("e2e_rl")


def test_jaxrl_steps_and_arm_summary(e2e, tmp_path):
    rows = [  # step 1 starts at wall_s - wait - step - publish = 1.0
        {"step": 1, "wall_s": 10.0, "wait_s": 4.0, "step_time_s": 4.5, "publish_s": 0.5, "valid_tokens": 100, "tokens": 600},
        {"step": 2, "wall_s": 12.0, "wait_s": 0.5, "step_time_s": 1.0, "publish_s": 0.1, "valid_tokens": 120, "tokens": 640},
        {"step": 3, "wall_s": 13.0, "wait_s": 0.2, "step_time_s": 0.6, "publish_s": 0.1, "valid_tokens": 100, "tokens": 500},
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    st = e2e.jaxrl_steps(tmp_path)
    assert [s["wall_s"] for s in st] == pytest.approx([9.0, 2.0, 1.0])
    assert st[1]["host_s"] == pytest.approx(2.0 - 0.5 - 1.0 - 0.1)
    s = e2e.arm_summary([{"steps": st, "rl_wall_s": 12.0, "heldout": {"success": 0.25}}], warmup=1)
    assert s["timed_steps"] == 2 and s["wall_s"] == pytest.approx(1.5)
    assert s["gen_tok_s"] == pytest.approx((60 + 100) / 2) and s["trained_tok_s"] == pytest.approx((320 + 500) / 2)
    assert s["heldout_final"] == 0.25 and s["rl_wall_s"] == 12.0


def _run(arm, rnd, walls):
    return {"arm": arm, "round": rnd, "steps": [{"wall_s": w} for w in walls]}


def test_round_ratios_pair_each_arm_with_its_reference_round_by_round(e2e):
    runs = {
        "tunix": [_run("tunix", 0, [9, 1.0, 1.0]), _run("tunix", 1, [9, 2.0, 2.0]), _run("tunix", 2, [9, 1.5, 1.5])],
        "jaxrl_k0": [_run("jaxrl_k0", 0, [9, 0.5, 0.5]), _run("jaxrl_k0", 1, [9, 2.0, 2.0]),
                     _run("jaxrl_k0", 2, [9, 1.0, 1.0])],
        "agentic_k2": [_run("agentic_k2", 0, [9, 1.0])],  # its reference (tunix_agentic_k2) did not run
        "tunix_agentic_k0": [_run("tunix_agentic_k0", 0, [9, 3.0])],
        "agentic_k0": [_run("agentic_k0", 0, [9, 1.0]), _run("agentic_k0", 1, [9, 1.0])],  # round 1 unpaired
    }
    rr = e2e.round_ratios(runs, warmup=1)
    assert rr["jaxrl_k0"]["rounds"] == pytest.approx([2.0, 1.0, 1.5])
    assert (rr["jaxrl_k0"]["median"], rr["jaxrl_k0"]["min"], rr["jaxrl_k0"]["max"]) == pytest.approx((1.5, 1.0, 2.0))
    assert rr["tunix"]["rounds"] == pytest.approx([1.0, 1.0, 1.0])
    assert rr["agentic_k0"]["rounds"] == pytest.approx([3.0])
    assert "agentic_k2" not in rr
    assert {e2e.REFERENCE[a] for a in e2e.ARMS} == {"tunix", "tunix_agentic_k0", "tunix_agentic_k2"}


def test_sizes_and_the_agentic_task_are_valid_configs(e2e, monkeypatch):
    from jax_rl.models.qwen3 import get_preset  # noqa: F401 (the preset table the overrides apply to)
    from tests.bench_module import ROOT

    monkeypatch.setenv(e2e.SIZE_ENV, "small")
    cfg = e2e.load_cfg(ROOT, e2e.AGENTIC_OVERRIDES)
    hf = cfg.model.hf_overrides
    assert (hf["hidden_size"], hf["num_hidden_layers"], hf["head_dim"]) == (256, 4, 32)
    assert hf["vocab_size"] >= cfg.model.bpe_vocab_size  # the BPE fits the embedding (a run would refuse)
    assert cfg.rollout.max_turns == e2e.AGENTIC_TURNS == 2 and cfg.rollout.render_tools
    assert cfg.rollout.max_cache_len <= cfg.optim.max_seq_len
    monkeypatch.setenv(e2e.SIZE_ENV, "tiny")
    tiny = e2e.load_cfg(ROOT)
    assert tiny.rollout.max_turns == 1 and "hidden_size" not in tiny.model.hf_overrides
    with pytest.raises(ValueError, match="--size"):
        e2e.size_overrides("huge")


def test_grouped_prompts_are_a_grpo_batch():
    from tests.bench_module import load_bench

    rd = load_bench("rollout_decode")
    ps = rd.grouped_prompts(64, 12, 100, groups=8)
    assert len(ps) == 64 and all(len(p) == 12 for p in ps)
    assert len({tuple(p) for p in ps}) == 8 and all(ps[8 * g] == ps[8 * g + 7] for g in range(8))
    assert len({tuple(p) for p in rd.grouped_prompts(16, 12, 100)}) == 16
    with pytest.raises(ValueError, match="groups"):
        rd.grouped_prompts(64, 12, 100, groups=7)


def test_a_crashed_run_costs_that_run_only(e2e, tmp_path, monkeypatch):
    """A worker killed by a signal (Tunix's agentic learner once died of SIGSEGV mid-bench) or exiting
    non-zero becomes a run record with ``error`` and no steps; the summaries leave it out."""
    segv = tmp_path / "segv.sh"  # stands in for the worker's interpreter: dies of SIGSEGV, as the crash did
    segv.write_text("#!/bin/sh\nkill -SEGV $$\n")
    segv.chmod(0o755)
    monkeypatch.setattr(e2e.sys, "executable", str(segv))
    rec = e2e.attempt(e2e._sub, ["_tunix_agentic"], 60, tmp_path / "w.log")
    assert rec["steps"] == [] and rec["rl_wall_s"] == 0.0
    assert rec["error"].startswith("RuntimeError") and "exited -11" in rec["error"] and "w.log" in rec["error"]
    monkeypatch.undo()
    rec = e2e.attempt(e2e._sub, ["_no_such_mode"], 60, tmp_path / "x.log")  # the real script, exit 1
    assert "exited 1" in rec["error"] and "unknown worker mode" in (tmp_path / "x.log").read_text()
    assert e2e.attempt(lambda x: {"steps": [x]}, 3) == {"steps": [3]}

    def interrupted():
        raise KeyboardInterrupt  # not a run failure: stops the bench

    with pytest.raises(KeyboardInterrupt):
        e2e.attempt(interrupted)
    failed = {**rec, "arm": "tunix_agentic_k0", "round": 1}
    runs = {"tunix_agentic_k0": [_run("tunix_agentic_k0", 0, [9, 4.0]), failed,
                                 _run("tunix_agentic_k0", 2, [9, 6.0])],
            "agentic_k0": [_run("agentic_k0", 0, [9, 1.0]), _run("agentic_k0", 1, [9, 1.0]),
                           _run("agentic_k0", 2, [9, 2.0])]}
    rr = e2e.round_ratios(runs, warmup=1)
    assert rr["agentic_k0"]["rounds"] == pytest.approx([4.0, 3.0])  # round 1 has no reference
    for r in runs["tunix_agentic_k0"]:
        r["rl_wall_s"] = 10.0
        for st in r["steps"]:
            st.update(gen_tokens=100, trained_tokens=400)
    s = e2e.arm_summary(runs["tunix_agentic_k0"], warmup=1)
    assert s["timed_steps"] == 2 and s["wall_s"] == pytest.approx(5.0) and s["rl_wall_s"] == 10.0


def test_question_text_reads_the_learners_numpy_rows(e2e):
    """Tunix's agentic learner hands each episode its batch row as numpy; rendered as is, the user turn
    came out empty (the bench's Tunix agentic arm ran on an empty question until this was caught)."""
    import numpy as np

    q = "State the final answer to the following arithmetic problem: 4 - 1 ="
    for x in (q, np.str_(q), np.array(q), np.array([q])):
        assert e2e.question_text(x) == q and type(e2e.question_text(x)) is str
    with pytest.raises(ValueError, match="one string"):
        e2e.question_text(np.array([q, q]))
    with pytest.raises(ValueError, match="one string"):
        e2e.question_text(np.array([], dtype=str))


def test_paged_arms_are_their_contiguous_twins_on_pages(e2e):
    """A ``_paged`` arm runs its twin's overrides plus ``rollout.kv_layout=paged`` (a valid config of the bench's
    task), takes its twin's Tunix reference, and gets a second per-round ratio against the twin."""
    from tests.bench_module import ROOT

    for arm, twin in e2e.CONTIGUOUS.items():
        assert arm in e2e.ARMS and twin in e2e.ARMS and e2e.REFERENCE[arm] == e2e.REFERENCE[twin]
        assert (arm in e2e.SINGLE_TURN_ARMS) == (twin in e2e.SINGLE_TURN_ARMS)
        mine, theirs = e2e.jaxrl_overrides(arm), e2e.jaxrl_overrides(twin)
        assert "rollout.kv_layout=paged" in mine and "rollout.kv_layout=contiguous" in theirs
        assert sorted(mine) == sorted(o.replace("=contiguous", "=paged") for o in theirs)
    assert set(e2e.CONTIGUOUS) == {"jaxrl_k0_paged", "jaxrl_k2_paged", "agentic_k0_paged", "agentic_k2_paged"}
    assert "async.max_staleness=2" in e2e.jaxrl_overrides("agentic_k2_paged")
    cfg = e2e.load_cfg(ROOT, e2e.jaxrl_overrides("agentic_k0_paged"))
    assert cfg.rollout.kv_layout == "paged" and cfg.rollout.max_turns == e2e.AGENTIC_TURNS
    assert [e2e.kv_layout(a) for a in ("tunix", "tunix_agentic_k0", "jaxrl_k0", "agentic_k0_paged")] == [
        None, None, "contiguous", "paged"]
    with pytest.raises(ValueError, match="tunix"):
        e2e.jaxrl_overrides("tunix")
    runs = {"jaxrl_k0": [_run("jaxrl_k0", 0, [9, 1.0]), _run("jaxrl_k0", 1, [9, 2.0])],
            "jaxrl_k0_paged": [_run("jaxrl_k0_paged", 0, [9, 2.0]), _run("jaxrl_k0_paged", 1, [9, 1.0])]}
    rr = e2e.round_ratios(runs, warmup=1, reference=e2e.CONTIGUOUS)
    assert list(rr) == ["jaxrl_k0_paged"] and rr["jaxrl_k0_paged"]["rounds"] == pytest.approx([0.5, 2.0])
