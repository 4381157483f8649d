"""MetricsWriter / read_jsonl (jax_rl.metrics) and the console display (jax_rl.console)."""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from jax_rl.console import TrainProgress, format_metrics, print_summary
from jax_rl.metrics import MetricsWriter, read_jsonl, sanitize, write_json


def test_write_rows_types_and_nonfinite(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        row = w.write(
            3,
            {
                "reward_mean": np.float32(0.5),
                "version": np.int64(3),
                "ewma_reset": True,
                "loss": float("nan"),
                "grad_norm": float("inf"),
                "losses": {"kl": np.array(0.25), "neg": -float("inf")},
                "staleness_hist": np.array([3.0, np.nan, 1.0]),
                "correction": "ppo_ewma",
                "one": np.array([7.0]),
            },
        )
        w.write(4, {"reward_mean": 0.75})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    rows = [json.loads(line) for line in lines]  # strict JSON: no NaN literals
    r = rows[0]
    assert r == row
    assert r["step"] == 3 and isinstance(r["step"], int)
    assert r["reward_mean"] == 0.5 and r["version"] == 3 and r["ewma_reset"] == 1
    assert r["loss"] is None and r["grad_norm"] is None and r["losses/neg"] is None
    assert r["losses/kl"] == 0.25
    assert r["staleness_hist"] == [3.0, None, 1.0]
    assert r["correction"] == "ppo_ewma" and r["one"] == 7.0
    assert r["nonfinite_keys"] == sorted(["grad_norm", "loss", "losses/neg", "staleness_hist"])
    assert "nonfinite_keys" not in rows[1]
    assert read_jsonl(tmp_path / "metrics.jsonl") == rows


def test_sanitize_never_raises_on_odd_values():
    class Weird:
        def __float__(self):
            raise RuntimeError("boom")

        def __str__(self):
            return "weird"

    flat, bad = sanitize({"a": Weird(), "b": None, "c": object(), "d": [1, "x", float("nan")]})
    assert flat["a"] == "weird" and flat["b"] is None and isinstance(flat["c"], str)
    assert flat["d"] == [1, "x", None] and bad == ["d"]


def test_write_eval_append_resume_and_close(tmp_path):
    w = MetricsWriter(tmp_path, tensorboard=False)
    w.write_eval(0, {"avg@4": 0.25, "calculator/pass@4": 0.5})
    w.close()
    w.close()  # idempotent
    with pytest.warns(RuntimeWarning):
        assert w.write(1, {"x": 1.0}) is None
    w2 = MetricsWriter(tmp_path, tensorboard=False)  # resumed run appends
    w2.write_eval(10, {"avg@4": 0.5})
    w2.close()
    ev = read_jsonl(tmp_path / "eval.jsonl")
    assert [e["step"] for e in ev] == [0, 10]
    assert ev[0]["calculator/pass@4"] == 0.5


def test_non_primary_writes_nothing(tmp_path):
    d = tmp_path / "run"
    w = MetricsWriter(d, tensorboard=True, wandb=True, is_primary=False)
    assert w.write(1, {"x": 1.0}) is None and w.write_eval(1, {"x": 1.0}) is None
    assert w.write_summary({"a": 1}) is None
    w.close()
    assert not d.exists()


def test_tensorboard_event_files(tmp_path):
    from tensorboardX.event_file_writer import EventFileWriter  # noqa: F401  (installed)

    with MetricsWriter(tmp_path) as w:
        w.write(1, {"reward_mean": 0.5, "bad": float("nan"), "name": "x"})
        w.write_eval(1, {"avg@1": 0.25})
    events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    # the scalar tags are in the event file
    data = b"".join(e.read_bytes() for e in events)
    assert b"reward_mean" in data and b"eval/avg_at_1" in data and b"bad" not in data


def test_wandb_missing_warns_once(tmp_path, monkeypatch):
    import jax_rl.metrics as m

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    monkeypatch.setattr(m, "_warned", set())
    with pytest.warns(RuntimeWarning, match="wandb is not installed"):
        w1 = MetricsWriter(tmp_path / "a", tensorboard=False, wandb=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        w2 = MetricsWriter(tmp_path / "b", tensorboard=False, wandb=True)
    w1.write(1, {"x": 1.0})
    w1.close()
    w2.close()
    assert read_jsonl(tmp_path / "a" / "metrics.jsonl")[0]["x"] == 1.0


def test_thread_safe_lines_are_whole(tmp_path):
    w = MetricsWriter(tmp_path, tensorboard=False)
    payload = {f"k{i}": float(i) for i in range(50)}

    def work(t):
        for s in range(40):
            w.write(t * 1000 + s, payload)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    w.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 160
    rows = [json.loads(x) for x in lines]
    assert sorted(r["step"] for r in rows) == sorted(t * 1000 + s for t in range(4) for s in range(40))


def test_read_jsonl_missing_empty_and_truncated(tmp_path):
    assert read_jsonl(tmp_path / "nope.jsonl") == []
    p = tmp_path / "m.jsonl"
    p.write_text("")
    assert read_jsonl(p) == []
    p.write_text('{"step": 1, "x": NaN}\n\n[1, 2]\n{"step": 2, "x": 1.0}\n{"step": 3, "x":')
    rows = read_jsonl(p)
    assert [r["step"] for r in rows] == [1, 2] and math.isnan(rows[0]["x"])


def test_write_json_summary(tmp_path):
    p = write_json(tmp_path / "summary.json", {"final_success": np.float64(0.9), "bad": float("nan"),
                                               "buffer": {"produced": np.int32(5)}})
    d = json.loads(p.read_text())
    assert d == {"final_success": 0.9, "bad": None, "buffer": {"produced": 5}}
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        s = json.loads(w.write_summary({"rl_steps": 3}).read_text())
    assert s["rl_steps"] == 3


def test_output_modules_do_not_import_jax():
    code = (
        "import sys; import jax_rl.metrics, jax_rl.plots, jax_rl.evaluation, jax_rl.console; "
        "bad = [m for m in sys.modules if m == 'jax' or m.startswith('jax.')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


# ----------------------------------------------------------------------------- console


METRICS = dict(reward_mean=0.5, train_infer_retained=0.98, clip_frac=0.0125, staleness_mean=0.75,
               staleness_max=2, tokens_per_s=1234.0)


def test_format_metrics():
    s = format_metrics({**METRICS, "clip_frac": None})
    assert s == "reward 0.500  R 0.980  clip nan  stale 0.75  smax 2  tok/s 1,234"
    assert format_metrics({}) == ""


def test_progress_non_tty_is_compact():
    buf = io.StringIO()
    con = Console(file=buf, force_terminal=False, width=200)
    with TrainProgress(200, console=con) as p:
        for s in range(1, 201):
            p.update(s, METRICS)
    lines = buf.getvalue().splitlines()
    assert 15 <= len(lines) <= 25, lines
    assert lines[0].startswith("[RL] step 1/200") and lines[-1].startswith("[RL] step 200/200 (100%)")
    assert "R 0.980" in lines[-1] and "tok/s 1,234" in lines[-1]


def test_progress_disabled_and_tty():
    buf = io.StringIO()
    with TrainProgress(5, enabled=False, console=Console(file=buf)) as p:
        p.update(1, METRICS)
    assert buf.getvalue() == ""
    buf = io.StringIO()
    con = Console(file=buf, force_terminal=True, width=160)
    with TrainProgress(4, console=con, description="SFT") as p:
        assert p.live
        for s in range(1, 5):
            p.update(s, METRICS)
    out = buf.getvalue()
    assert "SFT" in out and "4/4" in out and "reward 0.500" in out


def test_print_summary():
    buf = io.StringIO()
    con = Console(file=buf, width=120, force_terminal=False)
    print_summary(
        {"sft_success": 0.31, "final_success": 0.875, "wall_s": 812.25, "rl_steps": 200,
         "nan": float("nan"), "buffer": {"produced": 10, "dropped_stale": 1}, "[odd]": "x"},
        {"metrics": "runs/x/metrics.jsonl", "plots": ["runs/x/plots/a.png", "runs/x/plots/b.png"],
         "checkpoints": Path("runs/x/checkpoints"), "none": None},
        console=con,
    )
    out = buf.getvalue()
    for s in ("final_success", "0.875", "812.25", "200", "produced=10", "[odd]",
              "runs/x/metrics.jsonl", "runs/x/plots/b.png", "runs/x/checkpoints"):
        assert s in out, s
    assert len(out.splitlines()) < 40
