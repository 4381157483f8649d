"""Numbers must not move: a 4-step synchronous run of each correction mode reproduces the
``metrics.jsonl`` recorded before the correction-home redesign (issue "One home for the
off-policy correction").

The fixtures in ``tests/runtime/fixtures/numbers_<mode>.json`` were written by this file with
``JAXRL_RECORD_FIXTURES=1`` on the code before the redesign, and written again on 2026-12-02 when
the rollout sampler changed its draws on purpose (inverse CDF instead of
``jax.random.categorical``, same distribution; and the CPU cache's key-transposed score dot),
which moves every sampled token of these runs. Re-recorded on 2026-12-03, again with the code
before a redesign (commit e8f4d78, before the old-logit routes, the routing-replay policy and the
learner recipe got their homes), because the fixtures are host-bound past row 0: at the recording
commit d4132ff itself, on the 2026-12-03 host, row 1's ``denominator`` came out 131.0 against the
recorded 123.5. Row 0 is sampled from the SFT params and matches across hosts; the AdamW step at
lr 3e-2 turns ~1e-4 host roundings into parameter differences that flip a sampled token of the
next batch, and a different batch is a different row. The redesigned code reproduced the
re-recorded rows bit for bit on that host, all 5 modes x 4 steps. ``async.max_staleness=0`` makes the
run synchronous, so with a fixed ``run.seed`` every batch is the same from run to run.
Values compare at ``tests.numbers_fixture.RTOL_FIRST`` / ``RTOL_LATER`` (row 0 / later rows: across CPU hosts and layer layouts), with abs_tol 1e-4 (the ``kl_*`` metrics are ~1e-4 here: the bf16 rollout's rounding, which moves with the host), except the keys in ``tests.numbers_fixture.CHANGED_ON_PURPOSE`` (a definition
that changed on purpose) and wall-clock figures.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from jax_rl.config import CONFIG_DIR, load_config
from jax_rl.metrics import read_jsonl
from jax_rl.runtime.train import TIMING_KEYS, run_train
from tests.numbers_fixture import record_or_compare

FIXTURES = Path(__file__).parent / "fixtures"
MODES = ["ppo", "decoupled", "linear_prox", "ppo_ewma", "exact"]
RUN = [
    # the layout the fixtures were recorded in: the bf16 rollout's log-probs move with the layer
    # layout (XLA's excess-precision rewrites differ between a scan and unrolled layers), by more
    # than these tolerances on extreme statistics such as is_weight_max
    "model.scan_layers=false",
    # the K/V layout the fixtures were recorded in (base.yaml's default became paged in issue 61)
    "rollout.kv_layout=contiguous",
    "run.steps=4",
    "run.seed=7",
    "sft.steps=20",
    "sft.batch_size=4",
    "sft.num_demos=16",
    "eval.every=0",
    "eval.num_tasks=2",
    "eval.k=2",
    "async.max_staleness=0",
    "optim.batch_size=8",
    "optim.minibatches=2",
    "algo.group_size=4",
    "rollout.slots=8",
    "logging.progress=false",
    "logging.tensorboard=false",
    "checkpoint.every=0",
    "optim.warmup_steps=50",  # pinned: the recorded lr schedule must not follow later tiny_cpu edits
]


def _numbers(row: dict) -> dict:
    """The row without wall-clock figures, buffer counters (thread timing) and non-numbers."""
    return {k: v for k, v in row.items()
            if k not in TIMING_KEYS and not k.endswith("_s") and "per_s" not in k
            and not k.startswith("buffer/") and isinstance(v, (int, float)) and not isinstance(v, bool)}


def _run(tmp_path: Path, mode: str) -> list[dict]:
    cfg = load_config(CONFIG_DIR / "tiny_cpu.yaml", RUN + [f"loss.correction={mode}", f"run.dir={tmp_path / mode}"])
    assert run_train(cfg) == 0
    return [_numbers(r) for r in read_jsonl(tmp_path / mode / "metrics.jsonl")]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", MODES)
def test_metrics_match_the_recorded_run(tmp_path, mode):
    rows = _run(tmp_path, mode)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    record_or_compare(rows, FIXTURES / f"numbers_{mode}.json", mode, abs_tol=1e-4)
