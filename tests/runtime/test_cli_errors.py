"""Bad inputs to the CLI end in one line on stderr naming the culprit, exit code 2, and leave no
run dir behind where none existed."""

from __future__ import annotations

import pytest

from jax_rl.cli import main
from jax_rl.config import CONFIG_DIR

TINY_CFG = str(CONFIG_DIR / "tiny_cpu.yaml")


def _err(capsys, argv) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jax-rl:") and "\n" not in err, err
    return err


def test_resume_flag_may_precede_overrides(tmp_path, capsys):
    # argparse alone would reject "run.dir=..." after --resume as an unrecognized argument
    err = _err(capsys, ["train", TINY_CFG, "--resume", f"run.dir={tmp_path / 'nope'}"])
    assert "does not exist" in err and "nope" in err


@pytest.mark.parametrize("override, key", [("model.tokenizer=/nonexistent/tok.json", "model.tokenizer"),
                                           ("model.checkpoint=/nonexistent", "model.checkpoint")])
def test_missing_paths_name_their_key(tmp_path, capsys, override, key):
    err = _err(capsys, ["train", TINY_CFG, override, f"run.dir={tmp_path / 'r'}"])
    assert key in err and "/nonexistent" in err
    assert not (tmp_path / "r").exists()  # a config that cannot be built leaves no run dir


def test_eval_of_a_missing_dir_creates_nothing(tmp_path, capsys):
    err = _err(capsys, ["eval", str(tmp_path / "none"), TINY_CFG])
    assert err.startswith("jax-rl: error: no checkpoints at") and str(tmp_path / "none") in err, err
    assert "config error" not in err and "does not exist" in err  # the checkpoint is the culprit, not the config
    assert not (tmp_path / "none").exists()


@pytest.mark.parametrize("sub", ["", "checkpoints"])
def test_eval_and_export_of_a_dir_without_a_saved_step(tmp_path, capsys, sub):
    """A dir with no step dir (any dir; a run stopped before its first checkpoint) is refused by
    name before a checkpoint manager is opened on it (Orbax scans the dirs it manages in a thread
    that outlived the process: a traceback after the one line, under load)."""
    d = tmp_path / "run"
    (d / sub).mkdir(parents=True)
    (d / "notes").mkdir()
    for argv in (["eval", str(d), TINY_CFG], ["export", str(d), str(tmp_path / "out")]):
        err = _err(capsys, argv)
        assert "no checkpoints at" in err and "holds no step dir" in err, err
    assert sorted(p.name for p in d.iterdir()) == sorted({"notes", sub} - {""})
    assert not (tmp_path / "out").exists()


def test_resume_without_a_checkpoint(tmp_path, capsys):
    (tmp_path / "r").mkdir()
    err = _err(capsys, ["train", TINY_CFG, f"run.dir={tmp_path / 'r'}", "--resume", "logging.tensorboard=false"])
    assert "no checkpoint" in err


def test_resume_into_another_correction_is_one_line(tmp_path, capsys):
    from tests.runtime.test_train import TINY

    d = tmp_path / "r"
    capsys.readouterr()
    assert main(["sft", TINY_CFG, *TINY, f"run.dir={d}"]) == 0  # a checkpoint written by ppo_ewma
    err = _err(capsys, ["train", TINY_CFG, *TINY, f"run.dir={d}", "loss.correction=exact", "--resume"])
    assert "loss.correction" in err and "ppo_ewma" in err


@pytest.mark.slow  # make test: test_checkpoint_of_the_other_layer_layout_fails_in_one_line_naming_scan_layers
def test_resume_into_the_other_layer_layout_is_one_line_and_eval_reads_either(tmp_path, capsys):
    """A checkpoint saved with ``model.scan_layers=false`` (unrolled layers): a ``--resume`` with
    the default (stacked) is refused in one line naming the value to set, exit 2, nothing
    written; ``jax-rl eval`` of the run reads it in its own layout even when the run's
    config.yaml says ``scan_layers: true`` (runs saved before train honoured the key)."""
    import json

    from jax_rl.checkpoint import saved_layer_layout
    from tests.runtime.test_train import TINY

    d = tmp_path / "r"
    capsys.readouterr()
    assert main(["sft", TINY_CFG, *TINY, f"run.dir={d}", "model.scan_layers=false"]) == 0
    assert saved_layer_layout(d / "checkpoints") == "unrolled (one subtree per layer)"
    before = {str(p): p.stat().st_mtime_ns for p in d.rglob("*") if p.is_file()}
    err = _err(capsys, ["train", TINY_CFG, *TINY, f"run.dir={d}", "--resume"])
    assert "model.scan_layers=false" in err and "unrolled" in err and str(d / "checkpoints") in err, err
    assert {str(p): p.stat().st_mtime_ns for p in d.rglob("*") if p.is_file()} == before

    cfg_yaml = d / "config.yaml"
    text = cfg_yaml.read_text()
    assert "scan_layers: false" in text
    cfg_yaml.write_text(text.replace("scan_layers: false", "scan_layers: true"))
    capsys.readouterr()
    assert main(["eval", str(d), TINY_CFG, "eval.num_tasks=1", "eval.k=1"]) == 0
    out = capsys.readouterr().out
    assert "pass@1" in json.loads(out[out.index("{"):])


@pytest.mark.parametrize("sub", ["", "checkpoints", "checkpoints/3"])
def test_model_checkpoint_given_a_run_dir_names_the_export(tmp_path, capsys, sub):
    """model.checkpoint takes an HF dir: a jax-rl run dir (or its checkpoints/, a step dir) gets the
    `jax-rl export` command that makes one, as `jax-rl serve` does."""
    run = tmp_path / "run"
    (run / "checkpoints" / "3").mkdir(parents=True)
    (run / "config.yaml").write_text("x: 1\n")
    where = run / sub if sub else run
    err = _err(capsys, ["train", TINY_CFG, f"model.checkpoint={where}", "--dry-run"])
    assert "is a jax-rl run's checkpoint, not an HF checkpoint" in err and f"jax-rl export {where} OUT_DIR" in err, err
