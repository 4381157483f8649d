"""``jax-rl export RUN[/checkpoints/N] OUT_DIR``: a run's checkpoint as a Hugging Face directory.

``OUT_DIR`` gets ``config.json`` (Qwen3 / Qwen3-MoE, ``transformers`` format),
``model.safetensors`` (sharded with an index above 5 GiB), ``tokenizer.json`` (the run's
tokenizer: the run dir's saved one, else the one ``model.tokenizer`` names, the compact demo
tokenizer included) and ``jax_rl_export.json`` (provenance: source run, checkpoint step, policy
version). ``transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)`` loads it and
``jax-rl serve OUT_DIR`` serves it.

The model comes from the run's ``config.yaml`` (as ``jax-rl eval`` does); the params are the
learner's (fp32 master weights; ``dtype="bfloat16"`` stores bf16). The decoder layers are read in
the layout the checkpoint was saved in (stacked under ``model.scan_layers`` or one subtree per
layer; a run saved before train honoured ``model.scan_layers`` is unrolled whatever its
config.yaml says) and written as HF's ``model.layers.{i}.*`` either way. Restoring runs on one
device of this host whatever mesh the run trained on, and never joins the run's
``jax.distributed`` cluster. Writing goes to a temp dir next to ``OUT_DIR``, renamed into place
at the end, so a failed export leaves nothing behind.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import jax
import numpy as np

from jax_rl.checkpoint import resolve_checkpoint_dir
from jax_rl.config import RuntimeConfig, load_config
from jax_rl.learner.learner import Learner
from jax_rl.model_builder import (abstract_model_split, adopt_checkpoint_layer_layout, build_model_config,
                                  learner_model_kwargs)
from jax_rl.models import hf_io
from jax_rl.runtime.envs import build_tokenizer
from jax_rl.sharding import make_mesh

__all__ = ["ExportError", "export_checkpoint", "resolve_checkpoint"]

log = logging.getLogger(__name__)


class ExportError(ValueError):
    """An export input or output is unusable (the message names the path)."""


def resolve_checkpoint(path: str | os.PathLike) -> tuple[Path, Path, Optional[int]]:
    """``(run_dir, checkpoints_dir, step or None = latest)`` of a run dir, its ``checkpoints/`` dir
    or one step's dir ``checkpoints/N``.

    Raises:
      ExportError: no checkpoints dir there, or no ``config.yaml`` in the run dir.
    """
    run_dir, ckpt, step = resolve_checkpoint_dir(path, error=ExportError)
    if ckpt.name != "checkpoints":  # the run dir (its config.yaml) must be the checkpoints dir's parent
        raise ExportError(f"no checkpoints at {str(path)!r} (give a run dir, its checkpoints/ or checkpoints/N)")
    if not (run_dir / "config.yaml").is_file():
        raise ExportError(f"no config.yaml in the run dir {run_dir} (needed for the model architecture)")
    return run_dir, ckpt, step


def _check_out_dir(out_dir: Path) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"OUT_DIR {out_dir} is a file; give a new or empty directory")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ExportError(f"OUT_DIR {out_dir} exists and is not empty; give a new or empty directory")


def export_checkpoint(checkpoint: str | os.PathLike, out_dir: str | os.PathLike, *,
                      dtype: str = "float32") -> dict:
    """Write the HF directory of a run's checkpoint (latest, or the step named) to ``out_dir``.

    Args:
      checkpoint: a run dir, its ``checkpoints/`` dir, or ``checkpoints/N``.
      out_dir: new or empty directory (created, with parents).
      dtype: storage dtype of the weights, ``"float32"`` (the learner's master copy) or ``"bfloat16"``.

    Returns:
      the provenance dict written to ``jax_rl_export.json`` (``run_dir``, ``step``, ``version``,
      ``optimizer_step``, ``correction``, ``dtype``, ``files``).

    Raises:
      ExportError: bad checkpoint path, missing config.yaml or non-empty ``out_dir``.
      FileNotFoundError: no checkpoint in the checkpoints dir.
      jax_rl.checkpoint.CheckpointMismatchError: the checkpoint does not match the run's config.yaml.
    """
    if dtype not in ("float32", "bfloat16"):
        raise ExportError(f"dtype {dtype!r}: expected float32 or bfloat16")
    run_dir, ckpt, step = resolve_checkpoint(checkpoint)
    out = Path(out_dir)
    _check_out_dir(out)

    cfg = load_config(run_dir / "config.yaml")
    if cfg.model.tokenizer == "bpe" and (run_dir / "tokenizer.json").is_file():
        cfg.model.tokenizer = str(run_dir / "tokenizer.json")  # never retrain: take the run's own
    cfg.mesh.data = cfg.mesh.fsdp = cfg.mesh.tensor = cfg.mesh.expert = 1  # one device, any source mesh
    cfg.runtime = RuntimeConfig()  # never join the run's jax.distributed cluster
    cfg.resume = False

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    scratch = tempfile.TemporaryDirectory(prefix="jxrl-export-")
    learner = None
    try:
        cfg.run.dir = scratch.name  # a snapshot store (exact / measure_error) writes here, not in the run
        tok = build_tokenizer(cfg)
        mc = build_model_config(cfg, tok)
        note = adopt_checkpoint_layer_layout(cfg, ckpt, step, mc)  # either layout exports the same
        if note:
            log.warning("export: %s", note)
        mesh = make_mesh(data=1, fsdp=1, tensor=1, expert=1, devices=jax.devices()[:1])
        # zeros as the init (every value comes from the checkpoint): no random-init compile
        _, shapes, _ = abstract_model_split(mc, **learner_model_kwargs(cfg))
        zeros = jax.tree.map(lambda x: np.zeros(x.shape, np.float32), shapes)
        learner = Learner(cfg, mesh=mesh, model_config=mc, init_params=zeros)
        meta = learner.checkpoints.restore(ckpt, step=step, read_only=True)  # a live run's dir: touch nothing
        model = learner.model(learner.get_params())
        hf_io.save_pretrained(model, mc, tmp, dtype=dtype)
        src_tok = run_dir / "tokenizer.json"
        if src_tok.is_file():
            shutil.copyfile(src_tok, tmp / "tokenizer.json")
        else:
            tok.save(tmp / "tokenizer.json")
        info = {
            "run_dir": str(run_dir.resolve()),
            "step": int(step if step is not None else meta.get("version", learner.version)),
            "version": learner.version,
            "optimizer_step": learner.step,
            "correction": cfg.loss.correction,
            "dtype": dtype,
            "tokenizer": str(src_tok) if src_tok.is_file() else tok.name,
        }
        info["files"] = sorted(p.name for p in tmp.iterdir()) + ["jax_rl_export.json"]
        (tmp / "jax_rl_export.json").write_text(json.dumps(info, indent=2) + "\n")
        _check_out_dir(out)  # still empty?
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
        return info
    finally:
        if learner is not None:
            learner.close()
        scratch.cleanup()
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)

