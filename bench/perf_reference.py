"""Render ``docs/performance.md``, the reference of current figures, from the records in ``docs/results/perf/``.

    .venv/bin/python bench/perf_reference.py [--write | --check]

One JSON file per table (``NN_name.json``, rendered in file-name order)::

    {"title": str, "why": str (one line: what a reader needs of the history),
     "history": "history.md#anchor" (the dated narrative the figures come from),
     "columns": [str, ...],
     "rows": [{"cells": [cell, ...], "date": str, "commit": str, "host": str (machine and load),
               "command": str (what makes the figure), "record": "docs/results/<raw>.json" (optional),
               "source": str (optional: the history section the figure was copied from)}]}

A cell is a string copied bit for bit from the measurement, or ``{"at": "a.b.0.c", "fmt": "{:.2f}", "scale": n}``:
the value at that path of the row's ``record`` (dict keys and list indices), divided by ``scale`` when given and
formatted with ``fmt`` (a boolean as yes / no); ``"at"`` may be a list of paths, formatted together
(``"{:.2f}x [{:.2f}-{:.2f}]"``), so a figure that a raw record holds cannot drift from it. ``tests/test_docs.py`` fails when
``docs/performance.md`` differs from what this renders (regenerate with ``REGEN_COMMAND``, or ``make docs``).
To add a figure: add a row (or a table file) here, then regenerate; the old row's story moves to
``docs/history.md``. Raises ``ValueError`` naming the file, row and cell for a malformed table or an unreadable
``at`` path.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PERF_DIR = ROOT / "docs" / "results" / "perf"
DOC_PATH = ROOT / "docs" / "performance.md"
REGEN_COMMAND = ".venv/bin/python bench/perf_reference.py --write"
ROW_KEYS = ("cells", "date", "commit", "host", "command")


def load_tables(perf_dir: Path = PERF_DIR) -> list[tuple[str, dict]]:
    """Every table file of ``perf_dir`` as ``(file name, table)``, in file-name order."""
    return [(p.name, json.loads(p.read_text(encoding="utf-8"))) for p in sorted(perf_dir.glob("*.json"))]


def _at(record: object, path: str) -> object:
    """The value at a dotted path (``"paged.points.0.1"``) of a JSON value; KeyError/IndexError if absent."""
    node = record
    for part in path.split("."):
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def resolve_cell(cell: object, record_path: str | None, root: Path = ROOT) -> str:
    """A table cell as markdown text: a string as is, an ``{"at", "fmt", "scale"}`` cell read from the record."""
    if isinstance(cell, str):
        return cell
    if not isinstance(cell, dict) or "at" not in cell:
        raise ValueError(f"a cell is a string or {{'at': path, 'fmt': ...}}, got {cell!r}")
    if not record_path:
        raise ValueError(f"cell {cell!r} reads a record but its row names none ('record')")
    record = json.loads((root / record_path).read_text(encoding="utf-8"))
    values = []
    for path in [cell["at"]] if isinstance(cell["at"], str) else cell["at"]:
        try:
            value = _at(record, path)
        except (KeyError, IndexError, ValueError, TypeError) as e:
            raise ValueError(f"{record_path} has no value at {path!r} ({e!r})") from None
        if isinstance(value, bool):
            value = "yes" if value else "no"
        elif cell.get("scale"):
            value = value / cell["scale"]
        values.append(value)
    return cell.get("fmt", "{}").format(*values)


def check_table(name: str, table: dict, root: Path = ROOT) -> None:
    """Raise ValueError naming the file and row when a table lacks a field or a row's cells do not fit."""
    for key in ("title", "why", "history", "columns", "rows"):
        if not table.get(key):
            raise ValueError(f"{name}: no {key!r}")
    if "\n" in table["why"]:
        raise ValueError(f"{name}: 'why' is one line")
    for i, row in enumerate(table["rows"]):
        missing = [k for k in ROW_KEYS if not row.get(k)]
        if missing:
            raise ValueError(f"{name}: row {i} lacks {missing}")
        if len(row["cells"]) != len(table["columns"]):
            raise ValueError(f"{name}: row {i} has {len(row['cells'])} cells for {len(table['columns'])} columns")
        if row.get("record") and not (root / row["record"]).exists():
            raise ValueError(f"{name}: row {i} names a record that does not exist: {row['record']}")


def _slug(title: str) -> str:
    """GitHub's anchor of a heading (lowercase, punctuation dropped, spaces -> '-')."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def _plain(title: str) -> str:
    """A heading's text for a link: its part before the first parenthesis, without code marks."""
    return title.split(" (")[0].replace("`", "")


def _esc(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_table(name: str, table: dict, root: Path = ROOT) -> list[str]:
    """One table's markdown: title, the why line, the rows with date, commit, host and a command footnote."""
    check_table(name, table, root)
    commands: list[str] = []
    lines = [f"## {table['title']}", "", f"Why: {table['why']}", ""]
    head = [*table["columns"], "date", "commit", "host and load", "command", "record"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, row in enumerate(table["rows"]):
        try:
            cells = [resolve_cell(c, row.get("record"), root) for c in row["cells"]]
        except ValueError as e:
            raise ValueError(f"{name}: row {i}: {e}") from None
        if row["command"] not in commands:
            commands.append(row["command"])
        rec = row.get("record")
        rec_cell = f"[{Path(rec).name}]({Path(rec).relative_to('docs').as_posix()})" if rec else "-"
        lines.append("| " + " | ".join(_esc(c) for c in [*cells, row["date"], f"`{row['commit']}`" if " " not in
                                                         row["commit"] else row["commit"], row["host"],
                                                         f"({commands.index(row['command']) + 1})", rec_cell]) + " |")
    lines.append("")
    lines += [f"({k}) `{c}`  " for k, c in enumerate(commands, 1)]
    lines[-1] = lines[-1].rstrip()
    lines += ["", f"The measurements, older figures and what was tried: [history]({table['history']}).", ""]
    return lines


def render(perf_dir: Path = PERF_DIR, root: Path = ROOT) -> str:
    """The whole of ``docs/performance.md`` from the table files."""
    tables = load_tables(perf_dir)
    lines = [
        "# Performance figures",
        "",
        f"<!-- GENERATED by bench/perf_reference.py from docs/results/perf/*.json; do not edit by hand. "
        f"Regenerate: {REGEN_COMMAND} (or `make docs`) -->",
        "",
        "**Generated** from the records in [results/perf/](results/perf/) (one JSON file per table; a cell read from a "
        "raw record in `docs/results/` is formatted from it). The current figure of each workload, one row per "
        "measurement, with its date, commit, host load and the command that makes it. Scripts in `bench/` print "
        "these figures; no test asserts a time. Unless a row says otherwise, the machine is the 2-core CPU "
        "development host, usually shared with other jobs: compare rows within a table, not across hosts. "
        "TPU and GPU rows are compile-time estimates from the TPU compiler or XLA on that host, never a "
        "measured accelerator time (pod-scale compiles: [tpu.md](tpu.md)). The dated narrative behind every "
        "figure, the superseded figures and the experiments that were dropped: [history.md](history.md). "
        "Old-logit routes' costs: [correction.md](correction.md#what-each-mode-and-route-costs-measured); "
        "publish times: [usage.md](usage.md#publish-timings).",
        "",
        "A commit marked \"(doc commit)\" is the commit that recorded the figure in the docs (the measured tree is "
        "that commit or its parent); \"(N)\" in the command column points to the commands under each table.",
        "",
        "Tables:",
        "",
        *[f"{i + 1}. [{_plain(t['title'])}](#{_slug(t['title'])})" for i, (_, t) in enumerate(tables)],
        "",
    ]
    for name, table in tables:
        lines += render_table(name, table, root)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="write docs/performance.md")
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/performance.md is stale")
    args = ap.parse_args(argv)
    text = render()
    if args.write:
        DOC_PATH.write_text(text, encoding="utf-8")
        print(f"wrote {DOC_PATH.relative_to(ROOT)} ({len(text.splitlines())} lines)")
    elif args.check:
        current = DOC_PATH.read_text(encoding="utf-8") if DOC_PATH.exists() else ""
        if current != text:
            print(f"{DOC_PATH.relative_to(ROOT)} is stale; regenerate: {REGEN_COMMAND}", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
