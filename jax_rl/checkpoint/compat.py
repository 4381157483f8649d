"""Whether a checkpoint fits this run, and where it is (part of :mod:`jax_rl.checkpoint`): the model and
correction checks of a restore (:func:`check_compatible`, with the models described by name and size) and
:func:`resolve_checkpoint_dir`, the one place a checkpoint dir is resolved."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional


from jax_rl.checkpoint.faults import CheckpointMismatchError


# model fields that say what size a model is, shown first when a checkpoint's model differs
_SIZE_FIELDS = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "vocab_size")


def describe_model(arch: dict, name: Optional[str] = None) -> str:
    """``model.preset=tiny_dense (dense, hidden 64, 2 layers, 2 heads / 1 kv, vocab 640)`` from an
    HF config dict (``Qwen3Config.to_hf()``) and the config's model name, when known."""
    kind = f"MoE {arch.get('num_experts')} experts" if arch.get("num_experts") else "dense"
    size = (f"{kind}, hidden {arch.get('hidden_size')}, {arch.get('num_hidden_layers')} layers, "
            f"{arch.get('num_attention_heads')} heads / {arch.get('num_key_value_heads')} kv, "
            f"vocab {arch.get('vocab_size')}")
    return f"{name} ({size})" if name else f"a model ({size})"


def _saved_model_name(saved: dict, directory: Any) -> Optional[str]:
    """The saved run's ``model.preset=...`` / ``model.checkpoint=...``: from the metadata (newer
    checkpoints) or the run's config.yaml next to the checkpoints dir (YAML, no code run)."""
    if saved.get("model_name"):
        return str(saved["model_name"])
    try:
        import yaml

        m = (yaml.safe_load((Path(directory).parent / "config.yaml").read_text(encoding="utf-8")) or {}).get("model")
        if isinstance(m, dict):
            return model_name(m.get("preset"), m.get("checkpoint"))
    except Exception:  # noqa: BLE001 - no readable config.yaml: the sizes alone are shown
        pass
    return None


def model_name(preset: Any, checkpoint: Any) -> Optional[str]:
    """``model.checkpoint=PATH`` when set, else ``model.preset=NAME`` (None when neither)."""
    if checkpoint:
        return f"model.checkpoint={checkpoint}"
    return f"model.preset={preset}" if preset else None


def check_compatible(saved: dict, *, model_arch: dict, correction: str, directory: Any = "",
                     model: Optional[str] = None) -> None:
    """Refuse a restore whose saved run had another model architecture or correction mode.

    Args:
        saved: the checkpoint's metadata dict.
        model_arch: this run's model HF config dict.
        correction: this run's ``loss.correction``.
        model: this run's :func:`model_name` (shown in the message).

    Raises:
        CheckpointMismatchError: naming the saved model and this config's (name and size), then the
            differing fields (size fields first); or the two correction modes.
    """
    where = f" in {directory}" if directory else ""
    s_arch = saved.get("model_arch") or {}
    if s_arch and s_arch != model_arch:
        diff = sorted((k for k in set(s_arch) | set(model_arch) if s_arch.get(k) != model_arch.get(k)),
                      key=lambda k: (_SIZE_FIELDS.index(k) if k in _SIZE_FIELDS else len(_SIZE_FIELDS), k))
        shown = ", ".join(f"{k}: saved={s_arch.get(k)!r} now={model_arch.get(k)!r}" for k in diff[:6])
        raise CheckpointMismatchError(
            f"checkpoint{where} was written for {describe_model(s_arch, _saved_model_name(saved, directory))} "
            f"but this config asks for {describe_model(model_arch, model)} ({shown}); resume with the model "
            "the run was started with, or start a fresh run dir"
        )
    s_corr = saved.get("correction")
    if s_corr is not None and s_corr != correction:
        raise CheckpointMismatchError(
            f"checkpoint{where} was written with loss.correction={s_corr!r} but this run has "
            f"loss.correction={correction!r}; the train state (EWMA, snapshot store) differs between modes"
        )


def resolve_checkpoint_dir(where: Any, *, error: type = FileNotFoundError) -> tuple[Path, Path, Optional[int]]:
    """``(run_dir, checkpoints_dir, step or None = latest)``: the one place a checkpoint dir is
    resolved (the run context, ``jax-rl eval``, ``jax-rl export``, the learner's default).

    Args:
        where: a run config (``checkpoint.dir``, else ``run.dir/checkpoints``; the step is
            ``resume_step``), or a path given by the user: a run dir, its ``checkpoints/`` dir, or
            one step's dir ``checkpoints/N``.
        error: the exception class raised (a CLI passes its one-line error type).

    Raises:
        error: a config with neither ``checkpoint.dir`` nor ``run.dir``; a path with no
            checkpoint dir, a checkpoint dir with no step dir, or a step dir that does not exist.
    """
    if hasattr(where, "checkpoint") and hasattr(where, "run"):  # a Config (duck-typed: no import of config)
        ck, rd = where.checkpoint.dir, where.run.dir
        if not (ck or rd):
            raise error("no checkpoint dir: pass ckpt_dir or set checkpoint.dir / run.dir")
        ckpt = Path(ck) if ck else Path(rd) / "checkpoints"
        return (Path(rd) if rd else ckpt.parent), ckpt, where.resume_step
    p = Path(where)
    step = None
    if p.name.isdigit() and p.parent.name == "checkpoints":
        p, step = p.parent, int(p.name)
    ckpt = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    if not ckpt.is_dir():
        what = "does not exist" if not p.exists() else "is not a directory" if not p.is_dir() else "has no checkpoints"
        raise error(f"no checkpoints at {str(where)!r}: it {what} (give a run dir, its checkpoints/ or a step "
                    "dir checkpoints/N)")
    if step is not None and not (ckpt / str(step)).is_dir():
        raise error(f"no checkpoint step dir {ckpt / str(step)}")
    if step is None and not any(c.name.isdigit() and c.is_dir() for c in ckpt.iterdir()):
        # refused before a checkpoint manager is opened there (Orbax scans a dir it manages for its
        # temporary paths in a background thread: not something to do to an arbitrary directory)
        raise error(f"no checkpoints at {str(where)!r}: {ckpt} holds no step dir (checkpoints/N); give a run "
                    "dir that has saved a checkpoint, its checkpoints/ or a step dir checkpoints/N")
    return ckpt.parent, ckpt, step
