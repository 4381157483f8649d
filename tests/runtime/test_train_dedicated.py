"""``jax-rl train ... loss.correction=exact old_logits.route=dedicated`` end to end (embedded
runtime): the CLI run finishes and logs the route's metrics, its checkpointed buffer carries each
pending trajectory's ``old_logp``, a resume continues from it, and a checkpoint written by the
snapshot route (pending trajectories without ``old_logp``) resumes under ``dedicated`` with every
restored trajectory scored or dropped and counted, never trained unscored."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jax_rl.config import CONFIG_DIR, load_config
from jax_rl.metrics import read_jsonl
from jax_rl.runtime.train import run_train

from .test_train import TINY, _groups_conserved

ROOT = Path(__file__).resolve().parents[2]
DEDICATED = ["loss.correction=exact", "old_logits.route=dedicated"]


def _rows(d):
    return read_jsonl(Path(d) / "metrics.jsonl")


def _pending(run_dir: Path, step: int) -> list[list[dict]]:
    """The buffer's pending groups (of trajectory dicts) recorded in checkpoint ``step``'s metadata."""
    files = [f for f in (run_dir / "checkpoints" / str(step) / "metadata").rglob("*") if f.is_file()]
    for f in files:
        try:
            meta = json.loads(f.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue
        if isinstance(meta, dict) and "runtime" in meta:
            return meta["runtime"]["buffer"]["pending"]
    raise AssertionError(f"no run metadata among {files}")


def _sum(d: Path) -> dict:
    return json.loads((d / "summary.json").read_text())


def _conserved(s: dict) -> None:
    assert s["buffer_produced"] == (s["buffer_consumed"] + s["buffer_dropped_stale"] + s["buffer_dropped_unscored"]
                                    + s["buffer_pending"])
    _groups_conserved(s)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_cli_train_dedicated_then_resume(tmp_path):
    d = tmp_path / "ded"
    args = [sys.executable, "-m", "jax_rl.cli", "train", str(CONFIG_DIR / "tiny_cpu.yaml"), *TINY, *DEDICATED,
            "run.steps=2", "async.max_staleness=2", f"run.dir={d}"]
    p = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "old_logits.route=dedicated" in p.stdout  # the start-of-run cost line names the route
    rows = _rows(d)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["old_logits_forwards"] == 0.0  # the learner's own: none
        assert 1 <= r["old_logits_versions"] <= 3 and r["old_logits_bytes"] > 0
        assert r["old_logits_s"] >= 0 and r["old_logits_dropped"] == 0 and r["old_logits_scored"] > 0
        assert r["buffer/dropped_unscored"] == 0
    assert sum(r["old_logits_s"] for r in rows) > 0
    s = _sum(d)
    assert s["old_logits_scored"] >= 2 * 4 and s["old_logits_dropped"] == 0
    _conserved(s)
    pend = [t for g in _pending(d, 2) for t in g]
    assert all(len(t["old_logp"]) == len(t["tokens"]) for t in pend)  # the old logits survive the checkpoint

    cfg = load_config(CONFIG_DIR / "tiny_cpu.yaml", TINY + DEDICATED + ["run.steps=3", "async.max_staleness=2",
                                                                        f"run.dir={d}", "resume=true"])
    assert run_train(cfg) == 0
    rows = _rows(d)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["buffer/dropped_unscored"] == 0 and rows[-1]["old_logits_forwards"] == 0.0
    _conserved(_sum(d))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_snapshot_checkpoint_resumes_under_dedicated(tmp_path):
    """The snapshot route's buffer holds trajectories without old_logp: resumed under dedicated,
    those of the restored version are scored, older ones dropped and counted (dropped_unscored)."""
    d = tmp_path / "switch"
    common = TINY + ["loss.correction=exact", "async.max_staleness=2", f"run.dir={d}"]
    assert run_train(load_config(CONFIG_DIR / "tiny_cpu.yaml", common + ["run.steps=2"])) == 0
    groups = _pending(d, 2)
    assert groups and all("old_logp" not in t for g in groups for t in g)
    cfg = load_config(CONFIG_DIR / "tiny_cpu.yaml", common + ["run.steps=3", "resume=true",
                                                              "old_logits.route=dedicated"])
    assert run_train(cfg) == 0
    rows = _rows(d)
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["old_logits_forwards"] == 0.0
    s = _sum(d)
    _conserved(s)
    # the scorer holds only the restored version 2: a group with a token of an older one cannot be scored
    # exactly any more and is dropped whole; the others were scored and trained
    unscorable = sum(len(g) for g in groups if any(v != 2 for t in g for v, m in zip(t["versions"], t["loss_mask"])
                                                   if m))
    print(f"restored {sum(len(g) for g in groups)} unscored trajectories, {unscorable} of them unscorable")
    assert s["buffer_dropped_unscored"] == unscorable
