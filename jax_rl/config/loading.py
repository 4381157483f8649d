"""Loading a run config: YAML files with ``base_config`` inheritance, ``key=value`` overrides,
one-line errors naming the dotted key (with the closest valid key for a typo), dumping, the
config hash. (``configs/base.yaml`` and ``docs/config.md`` are rendered from the schema by
:mod:`jax_rl.config.reference`.)
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ValidationError

from jax_rl.config.schema import CONFIG_DIR, Config, ConfigError, move_keys

# --------------------------------------------------------------------------------------
# Loading, overrides, errors
# --------------------------------------------------------------------------------------


def _section_fields(model: type[BaseModel]) -> dict[str, Any]:
    out = {}
    for name, f in model.model_fields.items():
        out[f.alias or name] = f
    return out


def _valid_keys(model: type[BaseModel] = Config, prefix: str = "") -> list[str]:
    """All dotted keys of the schema (``loss.correction``, ...)."""
    keys = []
    for key, f in _section_fields(model).items():
        if key == "base_config":
            continue
        dotted = f"{prefix}{key}"
        keys.append(dotted)
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys.extend(_valid_keys(ann, dotted + "."))
    return keys


def _suggest(key: str) -> str:
    valid = _valid_keys()
    matches = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if not matches:
        leaf = key.split(".")[-1]
        by_leaf = {k.split(".")[-1]: k for k in valid}
        m = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.6)
        matches = [by_leaf[m[0]]] if m else []
    return f"; did you mean '{matches[0]}'?" if matches else ""


# keys where infinity would mean "no limit": the spelling for that is null
_NO_LIMIT_HINTS = {
    "optim.max_grad_norm": "; use null for no gradient clipping",
    "rollout.episode_timeout_s": "; use null for no time limit",
}


# pydantic's loc tags for the member of a union a value was tried against (``int``, ``list[int]``,
# ``function-after[...]``): not part of the key the user wrote
_UNION_TAG = re.compile(r"^(int|float|str|bool|none|[a-z-]+\[.*\])$")


def _format_errors(err: ValidationError, source: str) -> str:
    lines = []
    by_key: dict = {}  # a union's members fail one by one: one line per key, their messages joined
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"] if not (isinstance(p, str) and _UNION_TAG.match(p)))
        loc = loc.replace("async_", "async")
        if e["type"] == "extra_forbidden":
            lines.append(f"unknown config key '{loc}'{_suggest(loc)}")
        else:
            val = e.get("input")
            msg = e["msg"]
            if e["type"] == "literal_error" and "expected" in (e.get("ctx") or {}):
                msg = f"must be one of {e['ctx']['expected']}"
            msg = msg.removeprefix("Value error, ")
            if e["type"] == "finite_number":
                msg = "must be a finite number (no .inf / .nan)" + _NO_LIMIT_HINTS.get(loc, "")
            if not loc or isinstance(val, dict):  # a section-level rule: its message names the keys
                lines.append(f"invalid config{' in ' + repr(loc) if loc else ''}: {msg}")
            elif (loc, repr(val)) in by_key:
                lines[by_key[(loc, repr(val))]] += f", or {msg[:1].lower()}{msg[1:]}"
            else:
                by_key[(loc, repr(val))] = len(lines)
                lines.append(f"invalid value '{loc}'={val!r}: {msg}")
    return f"{source}: " + "; ".join(lines)


def _deep_merge(base: dict, delta: dict) -> dict:
    out = dict(base)
    for k, v in delta.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k not in ("hf_overrides", "dataset_config"):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _read_yaml(path: Path, _seen: Optional[set] = None, _what: str = "config file") -> dict:
    """Read a YAML file, resolving ``base_config`` (relative to the file) recursively.

    Raises:
        ConfigError: naming the file (and ``base_config`` for a parent): missing, a directory,
            unreadable, not UTF-8, invalid YAML, empty, not a mapping, a ``base_config`` that is not a
            file name, or a ``base_config`` cycle.
    """
    _seen = _seen or set()
    path = path.resolve()
    if path in _seen:
        raise ConfigError(f"{path}: base_config cycle")
    _seen.add(path)
    if not path.exists():
        raise ConfigError(f"{_what} not found: {path}")
    if path.is_dir():
        raise ConfigError(f"{_what} {path} is a directory, not a YAML file")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})") from None
    except OSError as e:
        raise ConfigError(f"{_what} {path}: cannot read it ({e.strerror or e})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {' '.join(str(e).split())}") from None
    if data is None:  # empty, or comments only: the defaults alone do not fit the default task
        raise ConfigError(f"{_what} {path} is empty (no settings); start from a config in {CONFIG_DIR}, e.g. a "
                          "file holding `base_config: tiny_cpu.yaml` (the CPU demo) and your changes")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    try:  # a moved key is read under its new name in the file that sets it, before the files merge
        data = move_keys(data, source=str(path))
    except ValueError as e:
        raise ConfigError(f"{path}: {e}") from None
    parent = data.pop("base_config", None)
    if parent is not None and (not isinstance(parent, str) or not parent.strip()):
        raise ConfigError(f"{path}: base_config={parent!r} must be a YAML file name (a string), "
                          "e.g. base_config: base.yaml")
    if parent:
        ppath = (path.parent / parent) if not Path(parent).is_absolute() else Path(parent)
        if not ppath.exists() and (CONFIG_DIR / parent).exists():
            ppath = CONFIG_DIR / parent
        data = _deep_merge(_read_yaml(ppath, _seen, _what=f"base_config of {path.name}:"), data)
    return data


def parse_overrides(items: list[str]) -> dict:
    """Turn ``["loss.correction=ppo", "mesh.fsdp=4"]`` into a nested dict.

    Values are parsed with YAML (so ``1e-4``, ``true``, ``null``, ``[a, b]`` work).

    Raises:
        ConfigError: an item without ``=`` or with an empty key.
    """
    out: dict = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like key.sub=value")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key or any(not p for p in key.split(".")):
            raise ConfigError(f"override '{item}' has an empty key")
        try:
            val = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            val = raw
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            if p == "runtime" and isinstance(node.get(p), str):  # `runtime=ray runtime.ray_workers=2`
                node[p] = {"kind": node[p]}
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"override '{item}' conflicts with an earlier override of '{p}'")
            node = nxt
        node[parts[-1]] = val
    return out


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Merge ``key=value`` overrides into a raw config dict (before validation)."""
    delta = parse_overrides(overrides)
    # `runtime=ray` sets runtime.kind even when the YAML has a runtime mapping
    if isinstance(delta.get("runtime"), str) and isinstance(data.get("runtime"), dict):
        delta["runtime"] = {"kind": delta["runtime"]}
    try:
        delta = move_keys(delta, source="override")
    except ValueError as e:
        raise ConfigError(f"overrides: {e}") from None
    return _deep_merge(data, delta)


def validate_config(data: dict, source: str = "config") -> Config:
    """Validate a raw dict into a :class:`Config`; raise :class:`ConfigError` naming every culprit."""
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, source)) from None


def resolve_config_path(path: str | Path) -> Path:
    """``path`` when it exists; else, for a relative path, the shipped config of that name in
    :data:`CONFIG_DIR` (``tiny_cpu``, ``tiny_cpu.yaml`` or ``configs/tiny_cpu.yaml`` from any directory, as an
    installed wheel runs them) when there is one; else ``path`` unchanged (the loader names it as missing)."""
    p = Path(path)
    if p.exists() or p.is_absolute():
        return p
    name = p.name if p.suffix in (".yaml", ".yml") else p.name + ".yaml"
    shipped = CONFIG_DIR / name
    if (len(p.parts) == 1 or p.parts[-2] == "configs") and shipped.is_file():
        return shipped
    return p


def load_config(path: Optional[str | Path] = None, overrides: Optional[list[str]] = None) -> Config:
    """Load ``path`` (default ``configs/base.yaml``) with its ``base_config`` chain and overrides.

    Args:
        path: a YAML file, or the name of a shipped config (:func:`resolve_config_path`). Relative
            ``base_config`` entries resolve next to the file, then in the packaged ``configs/`` dir.
        overrides: ``key.sub=value`` strings, applied last.

    Returns:
        The validated :class:`Config`. ``run.name`` defaults to the file's stem.

    Raises:
        ConfigError: missing file, bad YAML, unknown key (with a suggestion), bad value
            (naming key, value and constraint).
    """
    p = resolve_config_path(path) if path else CONFIG_DIR / "base.yaml"
    data = _read_yaml(p)
    data = apply_overrides(data, list(overrides or []))
    cfg = validate_config(data, source=str(path or p))
    if cfg.run.name is None:
        cfg.run.name = p.stem
    return cfg


def dump_config(cfg: Config, path: str | Path) -> Path:
    """Write the resolved config as YAML (``config.yaml`` in the run dir)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return path


def config_hash(cfg: Config, sections: tuple[str, ...] = ("model", "loss")) -> str:
    """Short sha256 over the given sections (stored in checkpoints to refuse mismatched restores)."""
    d = cfg.to_dict()
    blob = json.dumps({k: d[k] for k in sections}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _literal_choices(ann: Any) -> tuple:
    """The values of a ``Literal[...]`` annotation (also inside ``Optional``); () for any other."""
    from typing import get_args, get_origin

    if get_origin(ann) is Literal:
        return get_args(ann)
    return tuple(c for a in get_args(ann) for c in _literal_choices(a))
