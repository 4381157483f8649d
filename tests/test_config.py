"""Config system: loading, inheritance, overrides, every class of bad value, CLI errors."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from jax_rl.config import (
    CONFIG_DIR,
    Config,
    ConfigError,
    dump_config,
    load_config,
    parse_overrides,
    render_base_yaml,
)
from jax_rl.config import _valid_keys

ROOT = Path(__file__).resolve().parent.parent


def test_base_yaml_in_sync_with_schema():
    assert (CONFIG_DIR / "base.yaml").read_text() == render_base_yaml(), (
        "configs/base.yaml is stale: run `.venv/bin/python -m jax_rl.config --write`"
    )


def test_base_yaml_one_short_line_per_key():
    """Every line below the header is one key (or section) with a comment whose meaning, without its
    ``Choices:`` list, is at most 100 characters: the docstring's summary (the rest is in docs/config.md)."""
    text = (CONFIG_DIR / "base.yaml").read_text()
    body = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert len(body) == len(_valid_keys())  # every key and section once
    for ln in body:
        assert re.match(r"^ *[A-Za-z_][A-Za-z0-9_]*:( .+?)?  # \S", ln), f"not one key a line: {ln!r}"
        meaning = ln.split("  # ", 1)[1].split(" Choices: ")[0]
        assert len(meaning) <= 100, f"comment over 100 characters ({len(meaning)}): {ln!r}"


def test_one_command_regenerates_both_files(tmp_path, monkeypatch):
    """``python -m jax_rl.config --write`` (``reference.main``) writes base.yaml and config.md, each equal
    to its render; without ``--write`` the package's entry prints base.yaml."""
    from jax_rl.config import reference

    monkeypatch.setattr(reference, "BASE_PATH", tmp_path / "base.yaml")
    monkeypatch.setattr(reference, "DOC_PATH", tmp_path / "docs" / "config.md")
    assert reference.main(["--write"], prog="python -m jax_rl.config", prints="base") == 0
    assert (tmp_path / "base.yaml").read_text() == render_base_yaml()
    assert (tmp_path / "docs" / "config.md").read_text() == reference.render_config_reference()
    out = subprocess.run([sys.executable, "-m", "jax_rl.config"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stdout == render_base_yaml(), out.stderr[-500:]


def test_base_yaml_every_knob_commented():
    for line in (CONFIG_DIR / "base.yaml").read_text().splitlines():
        if line.startswith("  ") and ":" in line:
            comment = line.split("#", 1)[1].strip() if "#" in line else ""
            assert comment, f"knob without a comment: {line!r}"


def test_base_yaml_lists_every_enum_choice():
    from jax_rl.config import _literal_choices, _section_fields

    lines, section = {}, None  # (section, key) -> line
    for ln in (CONFIG_DIR / "base.yaml").read_text().splitlines():
        if ln and not ln.startswith((" ", "#")):
            section = ln.split(":", 1)[0]
        elif ln.startswith("  ") and ":" in ln:
            lines[(section, ln.split(":", 1)[0].strip())] = ln
    n = 0
    for section, f in _section_fields(Config).items():
        sub = f.annotation
        if not (isinstance(sub, type) and hasattr(sub, "model_fields")):
            continue
        for key, sf in _section_fields(sub).items():
            choices = _literal_choices(sf.annotation)
            if choices:
                line = lines[(section, key)]
                assert f"Choices: {' | '.join(choices)}." in line, (f"{section}.{key}", line)
                n += 1
    assert n == 26, n  # every Literal knob of the schema (rollout.quantize, rollout.moe_router_dtype: 22nd, 23rd; loss.ewma_reset: 24th; rollout.kv_layout: 25th; rollout.sampler: 26th)
    for (section, key), choice in [(("rollout", "partial"), "recompute_kv"), (("algo", "advantage"), "rloo"),
                                   (("loss", "train_infer_mode"), "none")]:
        assert choice in lines[(section, key)]


def test_base_equals_defaults():
    cfg = load_config(CONFIG_DIR / "base.yaml")
    d = cfg.to_dict()
    d.pop("run")
    ref = Config().to_dict()
    ref.pop("run")
    assert d == ref


def test_every_shipped_config_loads():
    for p in sorted(CONFIG_DIR.glob("*.yaml")):
        cfg = load_config(p)
        assert cfg.run.name == p.stem


def test_delta_file_inherits(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text(f"base_config: {CONFIG_DIR / 'base.yaml'}\nloss:\n  correction: exact\n")
    cfg = load_config(p)
    assert cfg.loss.correction == "exact"
    assert cfg.loss.clip_eps_low == Config().loss.clip_eps_low  # inherited


def test_overrides_types_and_nesting():
    cfg = load_config(
        CONFIG_DIR / "tiny_cpu.yaml",
        ["loss.correction=ppo", "async.max_staleness=0", "optim.lr=3e-4", "loss.dual_clip_c=3",
         "env.calculator.datasets=[chain_sum]", "logging.wandb=true", "runtime=ray", "runtime.ray_workers=3",
         "model.hf_overrides={hidden_size: 32}"],
    )
    assert cfg.loss.correction == "ppo"
    assert cfg.async_.max_staleness == 0
    assert cfg.optim.lr == pytest.approx(3e-4)
    assert cfg.loss.dual_clip_c == 3
    assert cfg.env.calculator.datasets == ["chain_sum"]
    assert cfg.logging.wandb is True
    assert cfg.runtime.kind == "ray" and cfg.runtime.ray_workers == 3
    assert cfg.model.hf_overrides == {"hidden_size": 32}


def test_parse_overrides_rejects_garbage():
    with pytest.raises(ConfigError, match="key.sub=value"):
        parse_overrides(["loss.correction"])
    with pytest.raises(ConfigError, match="empty key"):
        parse_overrides(["loss..x=1"])


def test_unknown_key_suggests_closest():
    with pytest.raises(ConfigError) as e:
        load_config(CONFIG_DIR / "tiny_cpu.yaml", ["loss.corection=ppo_ewma"])
    msg = str(e.value)
    assert "loss.corection" in msg and "loss.correction" in msg


def test_unknown_section_suggests():
    with pytest.raises(ConfigError, match="optim"):
        load_config(None, ["optimm.lr=1"])


@pytest.mark.parametrize(
    "override, names",
    [
        ("async.max_staleness=-1", ["async.max_staleness", "-1", "greater than or equal to 0"]),
        ("loss.correction=foo", ["loss.correction", "'foo'", "ppo_ewma"]),
        ("loss.train_infer_low=3.0", ["train_infer_low=3.0", "train_infer_high=2.0"]),
        ("loss.dual_clip_c=0.5", ["loss.dual_clip_c", "0.5", "greater than 1"]),
        ("optim.lr=0", ["optim.lr", "0", "greater than 0"]),
        ("mesh.fsdp=0", ["mesh.fsdp", "0"]),
        ("algo.group_size=5", ["optim.batch_size=32", "algo.group_size=5"]),
        ("optim.microbatches=abc", ["optim.microbatches", "'abc'"]),
        # time knobs used by sleeps / future timeouts in rollout threads: finite and bounded
        ("rollout.tool_latency_s=.inf", ["rollout.tool_latency_s", "inf", "finite"]),
        ("rollout.tool_latency_s=601", ["rollout.tool_latency_s", "less than or equal to 600"]),
        ("rollout.tool_latency_s=.nan", ["rollout.tool_latency_s", "nan"]),
        ("rollout.tool_latency_s=-1", ["rollout.tool_latency_s", "greater than or equal to 0"]),
        ("rollout.episode_timeout_s=.inf", ["rollout.episode_timeout_s", "inf", "null for no time limit"]),
        ("rollout.episode_timeout_s=1e9", ["rollout.episode_timeout_s", "less than or equal to 86400"]),
        ("rollout.max_consecutive_episode_errors=-1", ["rollout.max_consecutive_episode_errors", "-1"]),
    ],
)
def test_bad_values_name_key_value_constraint(override, names):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])  # base.yaml: optim.batch_size=32
    for n in names:
        assert n in str(e.value), (n, str(e.value))


def test_a_pool_too_small_for_one_sequence_is_refused_only_on_pages():
    """rollout.kv_pages sizes the paged layout's pool; the contiguous layout has none, so a config that sets it
    and switches to contiguous (tau2's pool with rollout.kv_layout=contiguous) is not refused for it."""
    small = ["rollout.max_cache_len=128", "rollout.kv_page_size=16", "rollout.kv_pages=3"]
    with pytest.raises(ConfigError, match=r"rollout.kv_pages=3 .* cannot hold one sequence \(at least 8 pages\)"):
        load_config(None, ["rollout.kv_layout=paged", *small])
    assert load_config(None, ["rollout.kv_layout=contiguous", *small]).rollout.kv_pages == 3


def test_two_mesh_wildcards_rejected():
    with pytest.raises(ConfigError, match="at most one mesh axis"):
        load_config(None, ["mesh.data=-1"])


def test_bad_yaml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    p = tmp_path / "bad.yaml"
    p.write_text("loss: [unclosed\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(p)
    p.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(p)


def test_dump_roundtrip(tmp_path):
    cfg = load_config(CONFIG_DIR / "tiny_cpu.yaml", ["loss.correction=exact"])
    out = dump_config(cfg, tmp_path / "config.yaml")
    again = load_config(out)
    assert again.to_dict() == cfg.to_dict()
    assert "async" in yaml.safe_load(out.read_text())


def test_cli_typo_exits_nonzero_with_suggestion():
    r = subprocess.run(
        [sys.executable, "-m", "jax_rl.cli", "train", str(CONFIG_DIR / "tiny_cpu.yaml"), "loss.corection=ppo_ewma"],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )
    assert r.returncode == 2
    assert "loss.corection" in r.stderr and "loss.correction" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("sub", ["train", "sft", "eval", "serve", "plot"])
def test_cli_help(sub):
    r = subprocess.run([sys.executable, "-m", "jax_rl.cli", sub, "--help"], capture_output=True, text=True,
                       cwd=ROOT, timeout=60)
    assert r.returncode == 0 and "usage" in r.stdout


# what a correction mode allows with it is asked of the registries (Correction.check, Route.check)
@pytest.mark.parametrize("overrides, names", [
    (["loss.correction=ppo", "old_logits.measure_error=true"], ["old_logits.measure_error=true", "'ppo'"]),
    (["loss.correction=exact", "old_logits.measure_error=true"], ["old_logits.measure_error=true", "'exact'"]),
    (["loss.correction=decoupled", "old_logits.route=dedicated"], ["old_logits.route=dedicated",
                                                                  "loss.correction=exact only"]),
    (["loss.correction=exact", "old_logits.route=retire", "runtime=ray"], ["old_logits.route=retire",
                                                                          "runtime=embedded only"]),
    (["loss.correction=exact", "placement.scorer=1"], ["placement.scorer=1", "old_logits.route=dedicated only",
                                                       "route=snapshot"]),
])
def test_mode_and_route_refusals_name_the_keys(overrides, names):
    from jax_rl.learner.correction import check_config, make_correction

    cfg = load_config(None, overrides)  # the config, a leaf, knows no mode's rules: the registries check
    with pytest.raises(ConfigError) as e:
        check_config(cfg)
    for n in names:
        assert n in str(e.value), (n, str(e.value))
    with pytest.raises(ConfigError) as e:  # and no strategy is built for a refused config
        make_correction(cfg)
    for n in names:
        assert n in str(e.value), (n, str(e.value))


def test_cli_refuses_a_mode_route_combination_in_one_line():
    """The registries' checks run in the CLI's loader: exit 2 and one line, before anything is built."""
    r = subprocess.run([sys.executable, "-m", "jax_rl.cli", "train", str(CONFIG_DIR / "tiny_cpu.yaml"),
                        "loss.correction=ppo", "old_logits.measure_error=true", "--print-config"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "old_logits.measure_error=true" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("mode", ["decoupled", "linear_prox", "ppo_ewma"])
def test_measure_error_allowed_for_every_approximation(mode):
    """The approximations are the strategies declaring ``approximate``, not a list in the config."""
    from jax_rl.learner.correction import REGISTRY

    assert REGISTRY[mode].approximate
    from jax_rl.learner.correction import check_config

    assert check_config(load_config(None, [f"loss.correction={mode}", "old_logits.measure_error=true"])
                        ).old_logits.measure_error


def test_moved_keys_read_under_their_new_name_with_a_note(tmp_path, caplog):
    """``rollout.group_size`` (and the other :data:`MOVED_KEYS`) still load from a file or an override: the
    value lands on the new key, the file that sets it wins over its base, and a note names the new key."""
    import logging

    from jax_rl.config import MOVED_KEYS
    from jax_rl.config import schema as S

    assert MOVED_KEYS["rollout.group_size"] == "algo.group_size"
    S._noted.clear()
    with caplog.at_level(logging.WARNING, logger="jax_rl.config"):
        cfg = load_config(CONFIG_DIR / "tiny_cpu.yaml", ["rollout.group_size=4", "rollout.temperature=0.7"])
    assert cfg.algo.group_size == 4 and cfg.algo.temperature == 0.7
    assert "rollout.group_size is algo.group_size now" in caplog.text
    assert "rollout.temperature is algo.temperature now" in caplog.text
    f = tmp_path / "old.yaml"  # tiny_cpu.yaml sets algo.group_size: 8; the child's old key overrides it
    f.write_text(f"base_config: {CONFIG_DIR / 'tiny_cpu.yaml'}\nrollout:\n  group_size: 2\n  advantage: rloo\n")
    cfg = load_config(f)
    assert cfg.algo.group_size == 2 and cfg.algo.advantage == "rloo"
    f.write_text(f"base_config: {CONFIG_DIR / 'tiny_cpu.yaml'}\nrollout:\n  group_size: 2\nalgo:\n  group_size: 4\n")
    with pytest.raises(ConfigError, match="rollout.group_size=2 and algo.group_size=4 disagree"):
        load_config(f)
    assert Config.model_validate({"rollout": {"group_size": 4}, "optim": {"batch_size": 8}}).algo.group_size == 4


def test_calculator_knobs_moved_under_env_calculator(tmp_path, caplog):
    """Each env's knobs are ``env.<name>``: calculator's old top-level ``env.datasets`` / ``env.dataset_config``
    still load, from a file or an override, under ``env.calculator.*`` with a one-line note; both set to
    different values is refused naming both."""
    import logging

    from jax_rl.config import schema as S

    S._noted.clear()
    with caplog.at_level(logging.WARNING, logger="jax_rl.config"):
        cfg = load_config(CONFIG_DIR / "tiny_cpu.yaml", ["env.datasets=[basic_arithmetic]"])
    assert cfg.env.calculator.datasets == ["basic_arithmetic"]
    assert "env.datasets is env.calculator.datasets now" in caplog.text
    f = tmp_path / "old.yaml"  # a file in the old shape, over tiny_cpu.yaml's env.calculator
    f.write_text(f"base_config: {CONFIG_DIR / 'tiny_cpu.yaml'}\nenv:\n  datasets: [chain_sum]\n"
                 "  dataset_config:\n    chain_sum: {min_terms: 3, max_terms: 3}\n")
    cfg = load_config(f)
    assert cfg.env.calculator.dataset_config == {"chain_sum": {"min_terms": 3, "max_terms": 3}}
    assert "datasets" not in cfg.env.model_dump() and "dataset_config" not in cfg.env.model_dump()
    with pytest.raises(ConfigError, match=r"env.datasets=\['chain_sum'\] and env.calculator.datasets=\['x'\] disagree"):
        load_config(CONFIG_DIR / "tiny_cpu.yaml", ["env.datasets=[chain_sum]", "env.calculator.datasets=[x]"])



def test_a_union_knob_names_the_key_not_pydantics_member_tags():
    """placement.learner takes an int or a list of device ids: a bad value is one message under the
    key the user wrote (pydantic tags each union member's error 'placement.learner.int',
    'placement.learner.list[int]')."""
    with pytest.raises(ConfigError) as e:
        load_config(CONFIG_DIR / "tiny_cpu.yaml", ["placement.learner=abc"])
    msg = str(e.value)
    assert msg.count("invalid value 'placement.learner'='abc'") == 1 and ".int'" not in msg and "list[int]" not in msg
    assert "valid integer" in msg and "valid list" in msg



def test_sft_batch_must_split_into_the_microbatches():
    """An SFT step accumulates over optim.microbatches: a batch that does not split is refused at load, in one
    line, before any demonstration is built (not as a BatchError minutes into the run)."""
    with pytest.raises(ConfigError, match=r"sft.batch_size=2 must be divisible by optim.microbatches=8") as e:
        load_config(None, ["optim.microbatches=8", "sft.batch_size=2", "sft.steps=5"])
    assert "\n" not in str(e.value)
    assert load_config(None, ["optim.microbatches=8", "sft.batch_size=2", "sft.steps=0"]).sft.batch_size == 2
    assert load_config(None, ["optim.microbatches=8", "sft.batch_size=16", "sft.steps=5"]).sft.batch_size == 16
