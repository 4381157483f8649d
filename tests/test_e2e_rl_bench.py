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
