"""The config's base pieces (part of :mod:`jax_rl.config`): :class:`ConfigError`, the section base class
:class:`_Section` (unknown keys and non-finite values refused), the keys that moved (:data:`MOVED_KEYS`,
:func:`move_keys`) and the configs directory."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, field_validator



BPE_CORPUS_DEMOS = 2000
"""Reference-solver demos (training seeds from ``env.train_seed_offset``) a ``model.tokenizer=bpe``
is trained on (:func:`jax_rl.runtime.envs.build_tokenizer`)."""

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
"""The shipped configs: ``jax_rl/configs``, package data in the wheel; in a checkout a symlink to the
top-level ``configs/`` (so ``configs/...`` paths and the packaged names are the same files)."""


MOVED_KEYS: dict[str, str] = {
    "old_logits.devices": "placement.scorer",
    "rollout.group_size": "algo.group_size",
    "rollout.advantage": "algo.advantage",
    "rollout.advantage_std_normalize": "algo.advantage_std_normalize",
    "rollout.temperature": "algo.temperature",
    "env.datasets": "env.calculator.datasets",
    "env.dataset_config": "env.calculator.dataset_config",
}
"""Old dotted key -> its new one. A config file or override that sets the old key still loads: the value
is read as the new key and a one-line note names it (:func:`move_keys`)."""

_log = logging.getLogger("jax_rl.config")
_noted: set[str] = set()


def move_keys(data: dict, source: str = "config") -> dict:
    """``data`` (a raw, nested config dict) with every :data:`MOVED_KEYS` old key under its new name; logs one
    note per old key and process.

    Raises:
        ValueError: the old and the new key both set, to different values.
    """
    out = dict(data)
    for old, new in MOVED_KEYS.items():
        *opath, okey = old.split(".")
        *npath, nkey = new.split(".")
        src = _get_path(out, opath)
        if not isinstance(src, dict) or okey not in src:
            continue
        src = dict(src)
        val = src.pop(okey)
        out = _set_path(out, opath, src)
        dst = _get_path(out, npath)
        dst = dict(dst) if isinstance(dst, dict) else {}
        if nkey in dst and dst[nkey] != val:
            raise ValueError(f"{old}={val!r} and {new}={dst[nkey]!r} disagree: {old} is the old name of {new}; "
                             f"keep only {new}")
        dst[nkey] = val
        out = _set_path(out, npath, dst)
        _warn_once(f"{source}: {old} is {new} now; read as {new}={val!r}", key=old)
    return out


def _get_path(d: dict, path: list[str]) -> Any:
    """``d[path[0]][path[1]]...`` (None where a level is missing)."""
    for p in path:
        d = d.get(p) if isinstance(d, dict) else None
    return d


def _set_path(d: dict, path: list[str], value: Any) -> dict:
    """A copy of ``d`` with ``value`` at ``path`` (the mappings on the way copied, missing ones made)."""
    if not path:
        return value
    out = dict(d)
    sub = out.get(path[0])
    out[path[0]] = _set_path(sub if isinstance(sub, dict) else {}, path[1:], value)
    return out


def _warn_once(msg: str, key: str | None = None) -> None:
    """Log a config warning once per process and ``key`` (default: the message itself; a config is validated
    again each time it is copied, and a moved key is noted once whatever its value)."""
    key = msg if key is None else key
    if key not in _noted:
        _noted.add(key)
        _log.warning("%s", msg)


class ConfigError(ValueError):
    """A configuration problem. The message names the dotted key, the value and the rule."""


def _nonfinite_path(v: Any, path: str = "") -> Optional[str]:
    """``path=value`` of the first non-finite float inside a nested dict/list (None if all finite)."""
    if isinstance(v, float) and not math.isfinite(v):
        return f"{path or 'value'}={v}"
    if isinstance(v, dict):
        items = ((f"{path}.{k}" if path else str(k), x) for k, x in v.items())
    elif isinstance(v, (list, tuple)):
        items = ((f"{path}[{i}]", x) for i, x in enumerate(v))
    else:
        return None
    for p, x in items:
        bad = _nonfinite_path(x, p)
        if bad is not None:
            return bad
    return None


class _Section(BaseModel):
    """Base of every section: unknown keys are errors, and no value anywhere may be a non-finite
    float (``.inf`` / ``.nan`` in YAML, ``inf`` / ``nan`` on the command line): float fields by
    ``allow_inf_nan=False``, free-form dict/list fields (``model.hf_overrides``,
    ``env.calculator.dataset_config``, ...) by :meth:`_finite_nested`. A limit that can be switched off says
    so with ``null`` (e.g. ``optim.max_grad_norm``, ``rollout.episode_timeout_s``)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True,
                              allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _finite_nested(cls, v: Any) -> Any:
        if isinstance(v, (dict, list, tuple)):
            bad = _nonfinite_path(v)
            if bad is not None:
                raise ValueError(f"{bad} is not a finite number")
        return v
