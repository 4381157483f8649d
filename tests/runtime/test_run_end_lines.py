"""The end of a run on the console (issue 63 item 6): the final eval at the last step gets its progress line like
the periodic ones, and the summary table has no row for an empty dict (``episode_failures_by_reason`` of a run
that lost no episode; summary.json keeps it)."""

from __future__ import annotations

import io
import json
from pathlib import Path

from rich.console import Console

from jax_rl.config import CONFIG_DIR, load_config
from jax_rl.console import print_summary
from jax_rl.runtime.train import run_train

from .test_train import TINY


def test_summary_table_drops_an_empty_dict_row():
    buf = io.StringIO()
    print_summary({"rl_steps": 2, "episode_failures_by_reason": {}, "buffer": {"dropped": 1}}, {},
                  console=Console(file=buf, width=200))
    out = buf.getvalue()
    assert "episode_failures_by_reason" not in out and "rl_steps" in out and "buffer" in out, out


def test_final_eval_has_its_progress_line(tmp_path, capsys):
    cfg = load_config(CONFIG_DIR / "tiny_cpu.yaml", TINY + [f"run.dir={tmp_path / 'r'}", "run.steps=2", "eval.every=1"])
    assert run_train(cfg) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("eval @ step")]
    assert [ln.split(":")[0] for ln in lines] == ["eval @ step 1", "eval @ step 2 (final)"], lines
    s = json.loads((Path(cfg.run.dir) / "summary.json").read_text())
    assert f"held-out success {s['final_success']:.3f}" in lines[-1]
    assert "episode_failures_by_reason" in s and "episode_failures_by_reason" not in out.split("run summary")[-1]
