"""Every entry point answers as ``jax-rl train`` does (issue 39): the held-out guard at config time
for every runtime, and in the Ray producer; one line and exit 2 for bad arguments, paths and files
of ``serve``, ``export``, ``eval``, ``plot``, ``compile`` and ``sft``; env knobs checked by a schema."""

from __future__ import annotations

import pytest

from jax_rl.cli import main
from jax_rl.config import CONFIG_DIR, Config, ConfigError, load_config

TINY_CFG = str(CONFIG_DIR / "tiny_cpu.yaml")


def _err(capsys, argv, rc: int = 2) -> str:
    capsys.readouterr()
    assert main(argv) == rc
    err = capsys.readouterr().err.strip()
    assert err.startswith("jax-rl") and "\n" not in err and "Traceback" not in err, err
    return err


# ---------------------------------------------------------------- held-out guard
@pytest.mark.parametrize("runtime", ["embedded", "ray"])
@pytest.mark.parametrize("overrides, words", [
    (["eval.seed_offset=50", "run.steps=10"], ["eval.seed_offset=50", "raise eval.seed_offset"]),
    (["env.train_seed_offset=1000000"], ["env.train_seed_offset=1000000", "eval.seed_offset=1000000"]),
    (["eval.seed_offset=4000", "run.steps=600"], ["run.steps=600", "4799"]),  # 600 steps x 8 groups
    (["eval.seed_offset=2500", "run.steps=10"], ["sft.num_demos=3000"]),
])
def test_held_out_guard_at_config_time(tmp_path, capsys, runtime, overrides, words):
    """Training seeds that would reach the held-out ones: one line naming the keys, exit 2, no run
    dir, under both runtimes (Ray trained on held-out tasks silently; embedded refused mid-run)."""
    d = tmp_path / "r"
    err = _err(capsys, ["train", TINY_CFG, f"runtime={runtime}", f"run.dir={d}", *overrides])
    assert all(w in err for w in words), err
    assert not d.exists()


def test_held_out_guard_counts_the_bpe_demos_and_sft_only_when_used():
    base = {"eval": {"seed_offset": 100}, "run": {"steps": 2}, "optim": {"batch_size": 8},
            "rollout": {"group_size": 4}}
    cfg = Config.model_validate(base)
    assert cfg.training_seed_uses() == {"rl": 4}  # sft.steps=0, compact tokenizer: RL only
    with pytest.raises(ValueError, match="model.tokenizer=bpe"):
        Config.model_validate({**base, "model": {"tokenizer": "bpe"}})
    with pytest.raises(ValueError, match="sft.num_demos=200"):
        Config.model_validate({**base, "sft": {"steps": 1, "num_demos": 200}})
    Config.model_validate({**base, "sft": {"steps": 1, "num_demos": 100}})  # seeds 0..99 < 100


def test_held_out_guard_in_the_ray_producer():
    """A seed past the config's lower bound (re-drawn groups) stops the Ray producer before it is
    dispatched or admitted: ``fatal`` names it (the loop then ends the run with exit 1, checkpoint
    and summary written), as the embedded producer does."""
    from jax_rl.runtime.ray_runtime import RayProducer

    cfg = load_config(TINY_CFG, ["runtime=ray", "eval.seed_offset=10000"])
    calls = []

    class _Remote:
        def __init__(self, name):
            self.name = name

        def remote(self, *a):
            calls.append(self.name)
            return True

    class _Ray:
        @staticmethod
        def get(x):
            return x

    p = RayProducer.__new__(RayProducer)
    p.cfg, p._ray, p._fatal, p.reissue, p.in_flight, p.per_worker, p.version = cfg, _Ray, None, [], {}, 2, 0
    p.buffer = type("B", (), {"admit": _Remote("admit")})()
    p.workers = [type("W", (), {"run_group": _Remote("run_group")})()]
    p.guard = type("G", (), {"fatal": None})()
    p.next_gid = 9999
    p._dispatch()  # two slots: seed 9999 goes out; seed 10000 is neither admitted nor sent
    assert calls == ["admit", "run_group"] and p.next_gid == 10000
    assert "training task seed 10000 reached eval.seed_offset=10000" in p.fatal
