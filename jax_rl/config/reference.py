"""The two files generated from the pydantic schema: ``configs/base.yaml`` and ``docs/config.md``.

Every key of :class:`jax_rl.config.Config`, dotted (``rollout.slots``), with its type, default and
meaning, read from the field's attribute docstring (the schema sets ``use_attribute_docstrings=True``,
so pydantic keeps it in ``FieldInfo.description``). A docstring's summary (:func:`summary`: its first
paragraph when a blank line follows it, else its first sentence) is the one-line comment of
``configs/base.yaml`` (:func:`render_base_yaml`: each key at its default, its choices, its summary)
and the meaning column of ``docs/config.md`` (:func:`render_config_reference`), whose "Details" under
each table carry the rest of the text. Sections are walked recursively, so a nested section
(``placement.*``, ``rollout.mesh.*``) gets its own table without touching this module; aliases are
used as written in YAML (``async``, not ``async_``).

``tests/test_config.py`` and ``tests/test_docs.py`` fail when a committed file differs from its
render. One command regenerates both::

    .venv/bin/python -m jax_rl.config --write     # (the same: python -m jax_rl.config.reference --write)
"""

from __future__ import annotations

import argparse
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Iterator, Literal, Optional

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from jax_rl.config.loading import _literal_choices, _section_fields
from jax_rl.config.schema import CONFIG_DIR, MOVED_KEYS, Config

DOC_PATH = Path(__file__).resolve().parent.parent.parent / "docs" / "config.md"
BASE_PATH = CONFIG_DIR / "base.yaml"
REGEN_COMMAND = ".venv/bin/python -m jax_rl.config --write"

# keys the YAML loader reads that carry no attribute docstring of their own
_FALLBACK_MEANING = {
    "base_config": "Parent config file, relative to this file (e.g. `base.yaml`); this file holds only deltas.",
}

_CONSTRAINTS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"),
                ("min_length", "len >="), ("max_length", "len <="), ("multiple_of", "multiple of"))


# --------------------------------------------------------------------------------------
# Schema walking
# --------------------------------------------------------------------------------------


def _section_type(ann: Any) -> Optional[type[BaseModel]]:
    """The section model of a field annotated ``Section`` or ``Optional[Section]`` (else None)."""
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        models = [a for a in typing.get_args(ann) if isinstance(a, type) and issubclass(a, BaseModel)]
        rest = [a for a in typing.get_args(ann) if a is not type(None) and a not in models]
        if len(models) == 1 and not rest:
            return models[0]
    return None


def _section_default(model: type[BaseModel], f: Optional[FieldInfo], parent_default: Any, key: str) -> Any:
    """The JSON default of a section: from its parent's dumped default, else the class's own."""
    if isinstance(parent_default, dict) and key in parent_default:
        return parent_default[key]
    try:
        return model().model_dump(mode="json", by_alias=True)
    except Exception:  # a section with required keys has no default of its own
        return None


def walk(model: type[BaseModel] = Config, prefix: str = "", defaults: Any = None
         ) -> Iterator[tuple[str, Optional[type[BaseModel]], Optional[FieldInfo], Any]]:
    """Yield ``(dotted_key, section_model_or_None, field, default)`` for every key, depth first.

    A section yields itself (with its model) before its keys. ``defaults`` is the section's
    dumped default (``model_dump(mode="json", by_alias=True)``); None means "take the class's".
    """
    if defaults is None:
        defaults = _section_default(model, None, None, "")
    for name, f in model.model_fields.items():
        key = f.alias or name
        dotted = f"{prefix}{key}"
        sub = _section_type(f.annotation)
        if sub is not None:
            sub_defaults = _section_default(sub, f, defaults, key)
            yield dotted, sub, f, sub_defaults
            # an Optional section that is null by default still documents its keys (class defaults)
            yield from walk(sub, dotted + ".", sub_defaults if isinstance(sub_defaults, dict) else None)
            continue
        if isinstance(defaults, dict) and key in defaults:
            default = defaults[key]
        else:  # excluded from the dump (base_config) or no dumped parent
            default = f.get_default(call_default_factory=True)
        yield dotted, None, f, default


# --------------------------------------------------------------------------------------
# Formatting
# --------------------------------------------------------------------------------------


def _constraints(metadata: list) -> str:
    parts = []
    for m in metadata:
        for attr, sym in _CONSTRAINTS:
            v = getattr(m, attr, None)
            if v is not None:
                parts.append(f"{sym} {v:g}" if isinstance(v, float) else f"{sym} {v}")
    return ", ".join(parts)


def format_type(ann: Any, metadata: Optional[list] = None) -> str:
    """A short readable type: ``int (>= 1)``, ``float | null``, ``auto | full | int (>= 1)``."""
    origin = typing.get_origin(ann)
    if ann is type(None):
        out = "null"
    elif origin is Literal:
        out = " | ".join(str(a) if not isinstance(a, str) else a for a in typing.get_args(ann))
    elif origin is typing.Annotated:
        base, *extra = typing.get_args(ann)
        meta = []
        for e in extra:
            meta.extend(getattr(e, "metadata", None) or [e])
        out = format_type(base, meta)
    elif origin in (typing.Union, types.UnionType):
        args = typing.get_args(ann)
        parts = [format_type(a) for a in args if a is not type(None)]
        if type(None) in args:
            parts.append("null")
        out = " | ".join(parts)
    elif isinstance(ann, type) and issubclass(ann, BaseModel):
        out = "section"
    elif isinstance(ann, type) and origin is None:
        out = ann.__name__
    else:
        out = re.sub(r"\btyping\.", "", str(ann)).replace("NoneType", "null")
    cons = _constraints(metadata or [])
    return f"{out} ({cons})" if cons else out


def format_default(v: Any) -> str:
    """A YAML flow rendering of a default value (``null``, ``true``, ``[a, b]``, ``{}``)."""
    s = yaml.safe_dump(v, default_flow_style=True, width=10_000).strip()
    return s[:-4].strip() if s.endswith("...") else s


def first_sentence(text: Optional[str], markdown: bool = True) -> str:
    """The first sentence of a docstring, whitespace collapsed, RST ``literals`` as markdown.

    Splits at a ``.``/``!``/``?`` followed by a space and a capital letter, outside parentheses
    and brackets, and not after ``e.g.`` / ``i.e.`` / ``vs.``.
    """
    t = " ".join((text or "").split())
    depth = 0
    for i, ch in enumerate(t):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth = max(0, depth - 1)
        elif ch in ".!?" and depth == 0 and t[i + 1:i + 2] == " " and t[i + 2:i + 3].isupper():
            if re.search(r"(?:\be\.g|\bi\.e|\bvs|\betc)\.$", t[:i + 1]):
                continue
            t = t[:i + 1]
            break
    return t.replace("``", "`") if markdown else t


def _cell(s: str) -> str:
    """Escape a table cell: a ``|`` ends a cell in GFM even inside a code span; a ``<`` outside a
    code span would start an HTML tag (``checkpoints/<N>``)."""
    parts = s.replace("\n", " ").split("`")
    parts = [p if i % 2 else re.sub(r"<(?=[A-Za-z/!?])", "&lt;", p) for i, p in enumerate(parts)]
    return "`".join(parts).replace("|", "\\|")


def summary(text: Optional[str]) -> str:
    """A docstring's one-line summary: its first paragraph when a blank line ends it (the PEP 257
    shape: a summary line, a blank line, the details), else its first sentence (:func:`first_sentence`)."""
    head, sep, _ = (text or "").strip().partition("\n\n")
    return " ".join(head.split()).replace("``", "`") if sep else first_sentence(text)


def details(text: Optional[str]) -> str:
    """What a docstring says beyond :func:`summary` (the paragraphs after the first; a one-paragraph
    docstring: the sentences after the first), whitespace collapsed; "" when nothing more."""
    t = (text or "").strip()
    head, sep, rest = t.partition("\n\n")
    if not sep:
        rest = " ".join(t.split())[len(first_sentence(t, markdown=False)):]
    return " ".join(rest.split()).replace("``", "`")


def _meaning(key: str, f: Optional[FieldInfo]) -> str:
    leaf = key.rsplit(".", 1)[-1]
    text = summary(f.description if f is not None else None)
    return text or _FALLBACK_MEANING.get(leaf, "")


def _section_doc(model: type[BaseModel]) -> str:
    return summary((model.__doc__ or "").strip())


def _intro(order: list[str], n_keys: int) -> list[str]:
    return [
        "# Configuration reference",
        "",
        "<!-- GENERATED from the pydantic schema in jax_rl/config/ by jax_rl/config/reference.py:",
        f"     do not edit by hand. Regenerate: {REGEN_COMMAND} -->",
        "",
        f"**Generated** from the schema in `jax_rl/config/`; regenerate with `{REGEN_COMMAND}`",
        "(it writes this file and `configs/base.yaml`; `tests/test_docs.py` fails when this file is stale). Every",
        "key is shown dotted, as on the command line (`jax-rl train CONFIG.yaml rollout.slots=16`); in YAML it",
        "nests under its section. `configs/base.yaml` holds the same keys at their defaults, each with the one-line",
        "meaning shown here. The meaning is the summary of the field's docstring in its section's module of",
        "`jax_rl/config/` (`model.py`, `training.py`, `rollout.py`, `run.py`); the rest of that docstring is under",
        "the section's table, in its \"Details\".",
        "",
        f"{n_keys} keys. Sections: " + ", ".join(f"[`{s}`](#{s.replace('.', '')})" for s in order if s) + ".",
        "",
    ]


def render_config_reference(root: type[BaseModel] = Config) -> str:
    """The markdown of ``docs/config.md``: one table per section (nested sections recursively), then
    the section's keys whose docstring says more than its summary, with the whole text."""
    rows_by_section: dict[str, list[str]] = {"": []}
    more: dict[str, list[str]] = {"": []}
    section_docs: dict[str, str] = {}
    order = [""]
    for key, sub, f, default in walk(root):
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        if sub is not None:
            rows_by_section[key], more[key] = [], []
            order.append(key)
            section_docs[key] = _section_doc(sub)
            if typing.get_origin(f.annotation) in (typing.Union, types.UnionType):  # Optional section
                rows_by_section[parent].append(
                    f"| `{key}` | section \\| null | `{format_default(default)}` | {_cell(section_docs[key])} |")
            continue
        rows_by_section[parent].append(
            f"| `{key}` | {_cell(format_type(f.annotation, f.metadata))} | `{_cell(format_default(default))}` "
            f"| {_cell(_meaning(key, f))} |")
        if details(f.description):
            more[parent].append(f"- `{key}`: {details(f.description)}")

    out = _intro(order, sum(len(r) for r in rows_by_section.values()))
    header = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for s in order:
        rows = rows_by_section[s]
        if s == "":
            out += ["## Top-level keys", ""]
        else:
            out += [f"{'#' * min(6, 2 + s.count('.'))} {s}", ""]
            if section_docs.get(s):
                out += [section_docs[s], ""]
        if rows:
            out += header + rows + [""]
        if more[s]:
            out += ["Details:", ""] + more[s] + [""]
    if root is not Config:
        return "\n".join(out).rstrip() + "\n"
    out += ["## Moved keys", "",
            "A config file or override that sets an old key still loads: the value is read under the new key and a",
            "one-line note names it. Setting both, to different values, is an error.", "",
            "| old key | new key |", "|---|---|"]
    out += [f"| `{old}` | `{new}` |" for old, new in MOVED_KEYS.items()]
    return "\n".join(out).rstrip() + "\n"


# --------------------------------------------------------------------------------------
# configs/base.yaml
# --------------------------------------------------------------------------------------


BASE_HEADER_LINES = (
    "# jax-rl base config: every knob, at its default, with a one-line comment.",
    "# Run/model files hold only deltas and start with `base_config: base.yaml`.",
    "# A base for deltas, not a run: `jax-rl train|sft|eval|compile` refuse this file (its default",
    "# model and tokenizer do not fit its own rollout.max_cache_len); --print-config shows it.",
    "# Override anything on the command line: jax-rl train CONFIG.yaml loss.correction=ppo mesh.fsdp=4",
    "# Each key's full meaning: docs/config.md (and the docstrings in jax_rl/config/).",
    f"# GENERATED from jax_rl/config/ by `{REGEN_COMMAND}` (also writes docs/config.md).",
)


def _base_comment(f: FieldInfo) -> str:
    """A key's comment in ``base.yaml``: its docstring's summary, then ``Choices: a | b.`` for an enum."""
    choices = _literal_choices(f.annotation)
    text = summary(f.description)
    return f"{text} Choices: {' | '.join(map(str, choices))}." if choices else text


def render_base_yaml() -> str:
    """Render ``configs/base.yaml``: every knob at its default, one line each (value, choices and
    the summary of its docstring; :func:`summary`).

    ``tests/test_config.py`` checks that the committed file equals this output, so the file and
    the schema cannot drift apart. Regenerate with ``python -m jax_rl.config --write``.
    """
    lines = [*BASE_HEADER_LINES, ""]

    def section(model: type[BaseModel], values: dict, indent: str) -> None:
        for sub, sf in _section_fields(model).items():
            ann = sf.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):  # a nested section (rollout.mesh)
                lines.append(f"{indent}{sub}:  # {_base_comment(sf)}")
                section(ann, values[sub], indent + "  ")
            else:
                lines.append(f"{indent}{sub}: {format_default(values[sub])}  # {_base_comment(sf)}")

    defaults = Config().to_dict()
    for key, f in _section_fields(Config).items():
        if key == "base_config":
            continue
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            lines.append(f"{key}:  # {_section_doc(ann)}")
            section(ann, defaults[key], "  ")
            lines.append("")
        else:
            lines.append(f"{key}: {format_default(defaults[key])}  # {_base_comment(f)}")
    return "\n".join(lines).rstrip() + "\n"


def write_all() -> list[Path]:
    """Write ``configs/base.yaml`` and ``docs/config.md`` from the schema; return their paths."""
    BASE_PATH.write_text(render_base_yaml(), encoding="utf-8")
    DOC_PATH.parent.mkdir(parents=True, exist_ok=True)
    DOC_PATH.write_text(render_config_reference(), encoding="utf-8")
    return [BASE_PATH, DOC_PATH]


def main(argv: Optional[list[str]] = None, prog: str = "python -m jax_rl.config.reference",
         prints: str = "reference") -> int:
    """``--write``: regenerate both files; else print one (``prints``: ``reference`` = docs/config.md,
    ``base`` = configs/base.yaml)."""
    p = argparse.ArgumentParser(prog=prog, description="Print a file generated from the config schema, or "
                                "--write both (configs/base.yaml and docs/config.md).")
    p.add_argument("--write", action="store_true", help=f"write {BASE_PATH} and {DOC_PATH} instead of printing")
    args = p.parse_args(argv)
    if args.write:
        for path in write_all():
            print(f"wrote {path}", file=sys.stderr)
    else:
        sys.stdout.write(render_base_yaml() if prints == "base" else render_config_reference())
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
