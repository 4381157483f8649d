"""Bad inputs that used to escape ``jax-rl`` as tracebacks (or run silently): each ends in one line
naming the key, file or path, exit 2, no run dir. Plus ``--print-config``, ``--dry-run``,
``--version`` and help on every argument."""

from __future__ import annotations

import json
import struct

import pytest
import yaml

from jax_rl.cli import build_parser, main
from jax_rl.config import CONFIG_DIR, load_config

TINY_CFG = str(CONFIG_DIR / "tiny_cpu.yaml")
# the compact byte tokenizer: no BPE training, so every case below fails within a second or two
# (its prompts are ~160 tokens, so the cache is raised to fit them: otherwise the start-of-run prompt
# check refuses every case first)
FAST = ["model.tokenizer=compact", "rollout.max_cache_len=256", "optim.max_seq_len=256"]
HF_CFG = {"model_type": "qwen3", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
          "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 64, "vocab_size": 512}


def _hf_dir(tmp, config: dict | str | None = None, safetensors: bytes | None = None) -> str:
    d = tmp / "hf"
    d.mkdir()
    (d / "config.json").write_text(config if isinstance(config, str) else json.dumps(config or HF_CFG))
    if safetensors is not None:
        (d / "model.safetensors").write_bytes(safetensors)
    return f"model.checkpoint={d}"


def _safetensors_past_eof() -> bytes:
    header = json.dumps({"model.embed_tokens.weight": {"dtype": "F32", "shape": [512, 32],
                                                       "data_offsets": [0, 512 * 32 * 4]}}).encode()
    return struct.pack("<Q", len(header)) + header + b"\0" * 10  # the data is cut off


def _write(tmp, name: str, data: bytes | str):
    p = tmp / name
    p.write_bytes(data) if isinstance(data, bytes) else p.write_text(data)
    return p


# (id, build(tmp) -> (config path, overrides), substrings the one-line message must contain)
BAD_INPUTS = [
    ("non_utf8_config", lambda t: (_write(t, "c.yaml", b"loss:\n  correction: \xff\n"), []),
     ["c.yaml", "not UTF-8"]),
    ("base_config_int", lambda t: (_write(t, "c.yaml", "base_config: 5\n"), []), ["c.yaml", "base_config=5"]),
    ("config_is_dir", lambda t: (t, []), [lambda t: str(t), "is a directory"]),
    ("base_config_is_dir", lambda t: (_write(t, "c.yaml", f"base_config: {t}\n"), []),
     ["base_config of c.yaml", "is a directory"]),
    ("mesh_fsdp_3", lambda t: (TINY_CFG, ["mesh.fsdp=3"]), ["mesh.fsdp=3", "mesh.data=1", "8 available device"]),
    ("mesh_tensor_3_wildcard", lambda t: (TINY_CFG, ["mesh.tensor=3"]), ["mesh.tensor=3", "mesh.fsdp=-1", "8 available"]),
    ("dataset_unknown", lambda t: (TINY_CFG, ["env.calculator.datasets=[nope]", "env.calculator.dataset_config={}"]),
     ["env.calculator.datasets", "'nope'"]),
    ("dataset_unknown_old_key", lambda t: (TINY_CFG, ["env.datasets=[nope]", "env.dataset_config={}"]),  # moved keys
     ["env.calculator.datasets", "'nope'"]),
    ("dataset_unknown_ray", lambda t: (TINY_CFG, ["runtime=ray", "env.calculator.datasets=[nope]",
                                                  "env.calculator.dataset_config={}"]),
     ["env.calculator.datasets", "'nope'"]),
    ("datasets_empty", lambda t: (TINY_CFG, ["env.calculator.datasets=[]"]), ["env.calculator.datasets=[]"]),
    ("dataset_config_typo", lambda t: (TINY_CFG, ["env.calculator.dataset_config={chain_sum: {min_termz: 2}}"]),
     ["env.calculator.dataset_config.chain_sum", "min_termz"]),
    ("retail_typo", lambda t: (TINY_CFG, ["env.name=retail", "env.retail={num_userz: 2}"]),
     ["env.retail.num_userz", "env.retail.num_users"]),
    ("safetensors_truncated_header", lambda t: (TINY_CFG, [_hf_dir(t, safetensors=b"\x10\0\0\0\0\0\0\0{")]),
     ["model.checkpoint", "model.safetensors", "header"]),
    ("safetensors_truncated_data", lambda t: (TINY_CFG, [_hf_dir(t, safetensors=_safetensors_past_eof())]),
     ["model.checkpoint", "model.safetensors", "past the end"]),
    ("hf_config_json_only", lambda t: (TINY_CFG, [_hf_dir(t)]), ["model.checkpoint", "no model.safetensors"]),
    ("hf_config_missing_fields", lambda t: (TINY_CFG, [_hf_dir(t, {"model_type": "qwen3", "hidden_size": 32})]),
     ["hf/config.json", "num_hidden_layers", "vocab_size"]),
    ("hf_config_garbage", lambda t: (TINY_CFG, [_hf_dir(t, "{not json")]), ["hf/config.json", "not valid JSON"]),
    ("tokenizer_not_json", lambda t: (TINY_CFG, [f"model.tokenizer={_write(t, 'tok.json', 'not json')}"]),
     ["model.tokenizer", "tok.json", "not a tokenizer.json"]),
    # 2 engines x 1e8 slots x 128 positions x 2 layers x 1 kv head x 64 x 2 (K, V) x 2 bytes (bf16): the contiguous
    # cache's message (the paged pool's: tests/runtime/test_one_line_errors.py)
    ("kv_cache_oom", lambda t: (TINY_CFG, ["rollout.slots=100000000", "rollout.max_cache_len=128", "optim.max_seq_len=128",
                                           "rollout.kv_layout=contiguous"]),
     ["rollout.slots=100000000", "rollout.max_cache_len=128", "13,107,200,000,000 bytes"]),
    ("measure_error_with_ppo", lambda t: (TINY_CFG, ["loss.correction=ppo", "old_logits.measure_error=true"]),
     ["old_logits.measure_error", "'ppo'"]),
]


@pytest.mark.parametrize("build, names", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_one_line_and_leaves_no_run_dir(tmp_path, capsys, build, names):
    src = tmp_path / "src"
    src.mkdir()
    cfg, overrides = build(src)
    run_dir = tmp_path / "run"
    capsys.readouterr()
    # the HF cases replace the model: drop tiny_cpu's head overrides so config.json is used as is
    extra = ["model.hf_overrides={}"] if any(o.startswith("model.checkpoint=") for o in overrides) else []
    assert main(["train", str(cfg), *FAST, *extra, *overrides, f"run.dir={run_dir}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jax-rl:") and "\n" not in err and "Traceback" not in err, err
    for n in names:
        n = n(src) if callable(n) else n
        assert n in err, (n, err)
    assert not run_dir.exists()


def test_print_config_prints_the_resolved_yaml_and_creates_nothing(tmp_path, capsys):
    argv = [TINY_CFG, "loss.correction=ppo", f"run.dir={tmp_path / 'r'}"]
    capsys.readouterr()
    assert main(["train", "--print-config", *argv]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed == load_config(argv[0], argv[1:]).to_dict()
    assert printed["loss"]["correction"] == "ppo" and printed["run"]["name"] == "tiny_cpu"
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_dry_run_reports_and_creates_nothing(tmp_path, capsys, layout):
    # exact: the step that takes the extra prox_logp input
    argv = ["train", TINY_CFG, "--dry-run", *FAST, "loss.correction=exact", "optim.batch_size=4",
            "algo.group_size=2", "optim.max_seq_len=32", "rollout.max_cache_len=32", "rollout.slots=4",
            "rollout.max_prefill_length=16", f"run.dir={tmp_path / 'r'}", f"rollout.kv_layout={layout}",
            "rollout.kv_page_size=16", "rollout.kv_pages=3"]
    capsys.readouterr()
    assert main(argv) == 0
    out = capsys.readouterr().out
    # tiny_cpu: 2 layers, 1 kv head of dim 64, bf16 rollout: 2*1*64*2*2 bytes a position; 2 engines of
    # 4 slots x 32 positions, or on pages of a pool of 3 pages of 16 positions whatever the slots
    per = (4 * 32 if layout == "contiguous" else 3 * 16) * 2 * 1 * 64 * 2 * 2
    assert "parameters" in out and "[4, 32]" in out and "compile" in out, out
    assert f"({2 * per:,} B) = 2 engine(s) x" in out and f"({per:,} B)" in out, out
    assert not (tmp_path / "r").exists()


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("jax-rl ")


def test_every_argument_has_help():
    sub = next(a for a in build_parser()._actions if a.choices and "train" in a.choices)
    for name, parser in sub.choices.items():
        if name == "serve":  # its arguments belong to the serve work (issue 16, another part)
            continue
        for a in parser._actions:
            assert a.help, f"jax-rl {name}: argument {a.dest!r} has no help"
