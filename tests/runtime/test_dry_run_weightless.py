"""``jax-rl train CONFIG --dry-run`` before the weights are downloaded: a pod config's placeholder
checkpoint / tokenizer paths do not stop it. It checks what needs no weights (shapes from the preset,
the mesh and placement arithmetic, memory per role; the train step's compile where the devices are here)
and says in ONE line what it skipped."""

import subprocess
import sys
from pathlib import Path

import pytest

from jax_rl.cli import main
from jax_rl.models.qwen3 import count_params, get_preset

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("config,preset", [("configs/qwen3_4b.yaml", "qwen3_4b"),
                                           ("configs/qwen3_30b_a3b.yaml", "qwen3_30b_a3b")])
def test_pod_config_dry_run_without_weights_or_devices(config, preset):
    r = subprocess.run([sys.executable, "-m", "jax_rl.cli", "train", config, "--dry-run"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"{count_params(get_preset(preset)):,}" in r.stdout  # the preset's shapes
    skipped = [ln for ln in r.stdout.splitlines() if ln.startswith("skipped (not on this host):")]
    assert len(skipped) == 1, r.stdout
    assert "model.checkpoint=/path/to/" in skipped[0] and "model.tokenizer=/path/to/" in skipped[0]
    assert "jax-rl compile" in skipped[0] and "learner per device" in r.stdout


def test_dry_run_with_absent_checkpoint_and_tokenizer_still_compiles_the_step(tmp_path, capsys):
    argv = ["train", "configs/tiny_cpu.yaml", "--dry-run", "model.checkpoint=/nonexistent/ckpt",
            "model.tokenizer=/nonexistent/ckpt/tokenizer.json", "loss.correction=ppo", "optim.batch_size=4",
            "algo.group_size=2", "optim.max_seq_len=32", "rollout.max_cache_len=32", "rollout.slots=4",
            "rollout.max_prefill_length=16", f"run.dir={tmp_path / 'r'}"]
    capsys.readouterr()
    assert main(argv) == 0
    out = capsys.readouterr().out
    cfg = get_preset("tiny_dense", num_attention_heads=2, num_key_value_heads=1, head_dim=64, rope_theta=10000.0,
                     vocab_size=640)  # tiny_cpu.yaml's model
    assert f"{count_params(cfg):,}" in out and "train-step compile" in out, out
    skipped = [ln for ln in out.splitlines() if ln.startswith("skipped (not on this host):")]
    assert len(skipped) == 1 and "/nonexistent/ckpt" in skipped[0] and "compact" in skipped[0], out
    assert "compiling" not in skipped[0]  # the step was compiled here
    assert not (tmp_path / "r").exists()


def test_absent_checkpoint_without_a_preset_is_one_config_error(capsys):
    assert main(["train", "configs/tiny_cpu.yaml", "--dry-run", "model.checkpoint=/nonexistent/ckpt",
                 "model.preset=null"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.checkpoint=/nonexistent/ckpt" in err[0], err
