"""The docs: no dead relative link in README.md or docs/*.md, README stays a front page, the generated
performance reference (docs/performance.md) matches its records, and the
generated configuration reference (docs/config.md) matches the schema."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal, Optional
from urllib.parse import unquote

import pytest
from pydantic import BaseModel, ConfigDict, Field

from jax_rl.config import reference as cr
from jax_rl.config import Config, _valid_keys
from tests.bench_module import load_bench

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# [text](target) and ![alt](target); the target ends at whitespace or ')' (an optional "title" follows)
_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)


def _strip_code(text: str) -> str:
    """Markdown without fenced blocks and code spans (a ``[x](y)`` in code is not a link)."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def markdown_links(text: str) -> list[str]:
    """Every inline-link, image and reference-definition target of a markdown text."""
    body = _strip_code(text)
    return _LINK.findall(body) + _REF_DEF.findall(body)


def _anchors(md: str) -> set[str]:
    """GitHub's heading anchors of a markdown text (lowercase, punctuation dropped, spaces -> '-')."""
    out = set()
    for line in _FENCE.sub("", md).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
            out.add(slug)
    return out


def dead_links(path: Path, root: Path = ROOT) -> list[str]:
    """Relative link targets of ``path`` that name no existing file (or no heading there)."""
    bad = []
    for target in markdown_links(path.read_text(encoding="utf-8")):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("//"):
            continue  # http:, https:, mailto: ...
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / unquote(file_part)).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{path.relative_to(root)}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text(encoding="utf-8")):
            bad.append(f"{path.relative_to(root)}: {target} (no heading #{anchor})")
    return bad


# ------------------------------------------------------------------------------------------
# links
# ------------------------------------------------------------------------------------------


def test_link_parser_finds_links_and_skips_code():
    md = ("see [a](docs/a.md) and ![img](results/x.png \"t\") and [b](https://x.org/y)\n"
          "`[not](a/link.md)`\n```\n[nor](this.md)\n```\n[ref]: docs/ref.md\n[n [nested]](n.md#sec)\n")
    assert markdown_links(md) == ["docs/a.md", "results/x.png", "https://x.org/y", "n.md#sec", "docs/ref.md"]


def test_dead_link_detector_fails_on_a_missing_file(tmp_path):
    (tmp_path / "there.md").write_text("# A title\n", encoding="utf-8")
    doc = tmp_path / "doc.md"
    doc.write_text("[ok](there.md) [ok2](there.md#a-title) [gone](missing.md) [bad](there.md#nope) "
                   "[web](https://example.org/none.md) [self](#local)\n# Local\n", encoding="utf-8")
    assert dead_links(doc, tmp_path) == ["doc.md: missing.md (no such file)", "doc.md: there.md#nope (no heading #nope)"]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_dead_relative_links(path):
    bad = dead_links(path)
    assert not bad, "dead links:\n" + "\n".join(bad)


def test_readme_is_a_front_page_linking_the_docs():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    n = len(text.splitlines())
    assert n <= 200, f"README.md has {n} lines; keep it a front page (<= 200) and move detail into docs/"
    targets = set(markdown_links(text))
    for doc in ("docs/config.md", "docs/usage.md", "docs/correction.md", "docs/tpu.md",
                "docs/performance.md", "docs/reliability.md", "docs/paper_repro.md", "docs/design.md",
                "docs/history.md", "docs/extending.md", "docs/placement.md", "docs/testing.md", "docs/interfaces.md"):
        assert doc in targets, f"README.md does not link {doc}"


# ------------------------------------------------------------------------------------------
# generated configuration reference
# ------------------------------------------------------------------------------------------


def test_config_reference_is_current():
    committed = cr.DOC_PATH.read_text(encoding="utf-8") if cr.DOC_PATH.exists() else ""
    if committed != cr.render_config_reference():
        pytest.fail(f"docs/config.md is stale (the schema in jax_rl/config/schema.py changed); regenerate it with:\n"
                    f"    {cr.REGEN_COMMAND}", pytrace=False)


def test_config_reference_lists_every_key_once():
    text = cr.render_config_reference()
    rows = re.findall(r"^\| `([^`]+)` \|", text, re.M)
    assert len(rows) == len(set(rows))
    expected = set(_valid_keys()) | {"base_config"}
    sections = {k for k in expected if any(r.startswith(k + ".") for r in expected)}
    assert expected - sections <= set(rows), f"keys missing: {sorted(expected - sections - set(rows))}"
    # nothing invented: every row is a schema key or a key inside one (an Optional section's keys)
    assert all(r in expected or any(r.startswith(k + ".") for k in expected) for r in rows)
    assert "async.max_staleness" in rows and not any(r.startswith("async_.") for r in rows)
    # every key has a meaning, and the default shown is the schema's
    defaults = Config().to_dict()
    line = next(ln for ln in text.splitlines() if ln.startswith("| `rollout.slots` |"))
    assert f"`{defaults['rollout']['slots']}`" in line and line.rstrip(" |").split("|")[-1].strip()
    for ln in text.splitlines():
        if ln.startswith("| `"):
            assert ln.rstrip().endswith("|") and ln.split(" | ")[-1].strip(" |"), f"no meaning: {ln}"


class _Leaf(BaseModel):
    """A nested section for the test."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    devices: Optional[list[int]] = None
    """Device ids of the role. More text that is not shown."""
    mode: Literal["a", "b"] = "b"
    """Pick a or b (e.g. a). Second sentence."""


class _Mid(BaseModel):
    """Middle section."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    slots: int = Field(4, ge=1)
    """Decode slots | per engine."""
    mesh: _Leaf = Field(default_factory=_Leaf)
    scorer: Optional[_Leaf] = None
    """Optional scorer section."""


class _Root(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, populate_by_name=True)
    async_: _Mid = Field(default_factory=_Mid, alias="async")
    top: float = Field(0.5, gt=0, le=1)
    """A top-level key."""


def test_config_reference_recurses_into_nested_and_optional_sections():
    text = cr.render_config_reference(_Root)
    rows = dict(re.findall(r"^\| `([^`]+)` \| (.*)$", text, re.M))
    assert set(rows) == {"top", "async.slots", "async.mesh.devices", "async.mesh.mode", "async.scorer",
                         "async.scorer.devices", "async.scorer.mode"}
    assert rows["async.slots"].startswith("int (>= 1) | `4` | Decode slots \\| per engine.")
    assert rows["async.mesh.mode"] == "a \\| b | `b` | Pick a or b (e.g. a). |"
    assert rows["async.mesh.devices"].startswith("list[int] \\| null | `null` | Device ids of the role. |")
    assert rows["top"].startswith("float (> 0, <= 1) | `0.5` |")
    assert rows["async.scorer"].startswith("section \\| null | `null` |")
    assert "### async.mesh" in text and "### async.scorer" in text and "## async" in text
    # the rest of a docstring is under its section's table, in its Details
    assert "- `async.mesh.devices`: More text that is not shown." in text
    assert "- `async.mesh.mode`: Second sentence." in text


@pytest.mark.parametrize("doc,head,rest", [
    ("Short. Longer text (e.g. more). End.", "Short.", "Longer text (e.g. more). End."),
    ("The summary line.\n\nThe details: a. b. C.", "The summary line.", "The details: a. b. C."),
    ("runtime=ray: pinned.\n\nruntime=ray: CPU ids. null = none.", "runtime=ray: pinned.", "runtime=ray: CPU ids. null = none."),
    ("Only ``one`` sentence.", "Only `one` sentence.", ""),
])
def test_summary_and_details_split_a_docstring(doc, head, rest):
    """A docstring's summary is its first paragraph (when a blank line follows it), else its first sentence;
    the details are what is left (docs/config.md shows both, base.yaml the summary)."""
    assert cr.summary(doc) == head and cr.details(doc) == rest


@pytest.mark.parametrize("doc,first", [
    ("Learner compute dtype. Master params are fp32.", "Learner compute dtype."),
    ("Slots (e.g. 4. More) per engine. Next.", "Slots (e.g. 4. More) per engine."),
    ("Use ``x`` e.g. Foo here. Then.", "Use `x` e.g. Foo here."),
    ("One line\n    wrapped. Two.", "One line wrapped."),
    (None, ""),
])
def test_first_sentence(doc, first):
    assert cr.first_sentence(doc) == first


# ------------------------------------------------------------------------------------------
# the design notes (docs/design.md): cited by section, nothing cited outside the repository
# ------------------------------------------------------------------------------------------

DESIGN = ROOT / "docs" / "design.md"
# Where the code and its docs live; every text file under these is checked.
CITING = [ROOT / d for d in ("jax_rl", "rollout", "bench", "tests", "configs", "tpu_scripts")] + [
    ROOT / "README.md", ROOT / "Makefile", ROOT / "pyproject.toml", *sorted((ROOT / "docs").glob("*.md"))]
# Notes kept outside the repository (the design notes and research notes the project started from).
# Each pattern is built from pieces, so that this file does not match itself.
_OUTSIDE = re.compile("|".join((
    "DESIGN" + r"\.md",
    "research" + "/",
    r"\.\./" + "shared",
    "paper" + "_spec",
    "jax" + "_anchors",
    "peers" + r"\.md",
    r"(?<![\w/.-])" + "env" + r"\.md",
)))
_CITE = re.compile("docs/design" + r"\.md\s+§(\d+(?:\.\d+)*)")
_SECTION = re.compile(r"^#{2,3}\s+(\d+(?:\.\d+)*)\.?\s+(.+?)\s*$", re.M)


def _text_files(paths: list[Path]):
    for top in paths:
        for p in ([top] if top.is_file() else sorted(top.rglob("*"))):
            if not p.is_file() or "__pycache__" in p.parts or p.suffix in (".pyc", ".png"):
                continue
            try:
                yield p, p.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue


def design_sections(md: str) -> dict[str, str]:
    """``{"2.3": "EWMA proximal", ...}``: the numbered ``##`` / ``###`` headings of a design doc."""
    return dict(_SECTION.findall(_FENCE.sub("", md)))


def bad_design_citations(text: str, sections: dict[str, str]) -> list[str]:
    """Citations ``docs/design.md §N Title`` (across line breaks and ``#`` comment continuations)
    whose N is no section, or that are not followed by that section's title."""
    flat = re.sub(r"\s*\n\s*(?:#+\s*)?", " ", text)
    bad = []
    for m in _CITE.finditer(flat):
        num, after = m.group(1), flat[m.end():].lstrip()
        if num not in sections:
            bad.append(f"§{num} (no such section)")
        elif not after.startswith(sections[num]):
            bad.append(f"§{num} {after[:30]!r}... (write: §{num} {sections[num]})")
    return bad


def test_design_citation_checker():
    d = "docs/design" + ".md"  # built from pieces: this file's own text is scanned too
    sections = design_sections("# T\n## 2. Ratio decomposition\n### 2.3 EWMA proximal\n```\n## 9. In code\n```\n")
    assert sections == {"2": "Ratio decomposition", "2.3": "EWMA proximal"}
    ok = f'x = 1  # see {d} §2.3\n    # EWMA proximal.\n"""({d} §2 Ratio decomposition)"""'
    assert bad_design_citations(ok, sections) == []
    assert bad_design_citations(f"{d} §4 Layout", sections) == ["§4 (no such section)"]
    assert bad_design_citations(f"{d} §2 the ratio", sections)[0].startswith("§2 'the ratio'")


def test_outside_pattern_matches_the_old_citations():
    for s in ("DESIGN" + ".md §3", "``" + "resear" + "ch/" + "paper" + "_spec.md``", "../" + "shared/x.md",
              "paper" + "_spec §6", "(" + "env" + ".md §6)"):
        assert _OUTSIDE.search(s), s
    for s in ("docs/" + "design.md §3", "the environment", "my_en" + "v.md", "docs/reliability.md"):
        assert not _OUTSIDE.search(s), s


def test_no_citation_of_files_outside_the_repository():
    bad = [f"{p.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
           for p, text in _text_files(CITING) for m in _OUTSIDE.finditer(text)]
    assert not bad, ("these cite notes outside the repository; cite docs/design.md §N <title> (or the paper, "
                     "AReaL, ...) instead:\n" + "\n".join(bad))


def test_design_doc_exists_and_every_citation_names_a_section():
    assert DESIGN.is_file(), "docs/design.md is missing"
    sections = design_sections(DESIGN.read_text(encoding="utf-8"))
    assert {"1", "2", "3", "4", "5"} <= set(sections), sorted(sections)
    n, bad = 0, []
    for p, text in _text_files(CITING):
        n += len(_CITE.findall(re.sub(r"\s*\n\s*(?:#+\s*)?", " ", text)))
        bad += [f"{p.relative_to(ROOT)}: {b}" for b in bad_design_citations(text, sections)]
    assert n > 0, "no docstring cites docs/design.md"
    assert not bad, "citations of docs/design.md that name no section of it:\n" + "\n".join(bad)


# Words that tell a reader what the code or the project *was* ("wave 2", "issue 27", "as before", a
# date): they belong in docs/ (with the date), not in code a reader wants to read as what *is*.
HISTORY = re.compile(r"\bwave[- ]?\d|\bissues? #?\d+|\bas before\b|\bpreviously\b|\bformerly\b|\bused to be\b"
                     r"|\b20\d\d-\d\d-\d\d\b|\(was |\b(is|are) now\b|\bre-?measured\b|\bold name\b", re.I)


def _comments_and_docstrings(path: Path) -> list[tuple[int, str]]:
    import ast
    import io
    import tokenize

    src = path.read_text(encoding="utf-8")
    out = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(src).readline)
           if t.type == tokenize.COMMENT]
    out += [(n.lineno, n.value.value) for n in ast.walk(ast.parse(src))
            if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)]
    return out


def test_history_words_pattern():
    for hit in ("wave 2 code", "issue 27", "as before", "(was old_logits.devices)", "measured 2026-12-03",
                "is now on by default", "re-measured"):
        assert HISTORY.search(hit), hit
    for ok in ("the version it was generated at", "prefilled now on a miss", "a wave of requests"):
        assert not HISTORY.search(ok), ok


def test_no_history_words_in_code_or_the_readme():
    """Comments and docstrings of jax_rl/ and rollout/, and the README, say what is: no history words
    and no dated measurement (those go in docs/, with the date and host load)."""
    bad = []
    for pkg in ("jax_rl", "rollout"):
        for p in sorted((ROOT / pkg).rglob("*.py")):
            for line, text in _comments_and_docstrings(p):
                bad += [f"{p.relative_to(ROOT)}:{line}: {m.group(0)!r}" for m in HISTORY.finditer(text)]
    readme = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    bad += [f"README.md:{i}: {m.group(0)!r}" for i, t in enumerate(readme, 1) for m in HISTORY.finditer(t)]
    assert not bad, "history words (move them to docs/):\n" + "\n".join(bad)


# ------------------------------------------------------------------------------------------
# generated performance reference (docs/performance.md from docs/results/perf/*.json)
# ------------------------------------------------------------------------------------------


def _perf():
    return load_bench("perf_reference")


def test_performance_reference_is_current():
    pr = _perf()
    committed = pr.DOC_PATH.read_text(encoding="utf-8") if pr.DOC_PATH.exists() else ""
    if committed != pr.render():
        pytest.fail("docs/performance.md differs from what its records render (docs/results/perf/*.json); "
                    f"regenerate it with:\n    {pr.REGEN_COMMAND}", pytrace=False)


def test_every_performance_row_has_date_commit_host_and_command():
    pr = _perf()
    tables = pr.load_tables()
    assert len(tables) >= 10
    for name, table in tables:
        pr.check_table(name, table)  # raises naming the file and row


def test_a_record_cell_is_read_from_its_record_and_a_bad_path_is_named(tmp_path):
    pr = _perf()
    (tmp_path / "rec.json").write_text('{"paged": {"points": [[8, 3221225472]], "episodes": 169}}', encoding="utf-8")
    assert pr.resolve_cell({"at": "paged.points.0.1", "fmt": "{:.2f}", "scale": 2 ** 30}, "rec.json", tmp_path) == "3.00"
    assert pr.resolve_cell({"at": "paged.episodes", "fmt": "**{}**"}, "rec.json", tmp_path) == "**169**"
    assert pr.resolve_cell("0.99x [0.93-1.10]", None, tmp_path) == "0.99x [0.93-1.10]"
    assert pr.resolve_cell({"at": ["paged.episodes", "paged.points.0.0"], "fmt": "{}x [{:.1f}]"}, "rec.json",
                           tmp_path) == "169x [8.0]"
    with pytest.raises(ValueError, match="paged.nope"):
        pr.resolve_cell({"at": "paged.nope"}, "rec.json", tmp_path)
    table = {"title": "t", "why": "w", "history": "history.md", "columns": ["a", "b"],
             "rows": [{"cells": ["1"], "date": "d", "commit": "c", "host": "h", "command": "x"}]}
    with pytest.raises(ValueError, match="row 0 has 1 cells for 2 columns"):
        pr.check_table("t.json", table, tmp_path)
    table["rows"][0]["cells"] = ["1", "2"]
    del table["rows"][0]["command"]
    with pytest.raises(ValueError, match=r"row 0 lacks \['command'\]"):
        pr.check_table("t.json", table, tmp_path)


# ------------------------------------------------------------------------------------------
# module maps: docs/design.md §4 Layout and each package __init__'s map name every module, and only those
# ------------------------------------------------------------------------------------------

CODE_PACKAGES = ("jax_rl", "rollout")
# a module path as maps write it: lowercase parts (``K/V`` is no folder), ``x.py`` or ``x/``, maybe ``../``-relative
_PATH_TOKEN = re.compile(r"(?<![\w./-])((?:\.\./)*[a-z_][a-z0-9_]*(?:/[a-z_][a-z0-9_]*)*(?:\.py\b|/))")


def code_modules(root: Path = ROOT) -> set[str]:
    """Every module and package of the code, as paths relative to ``root`` (``jax_rl/cli.py``, ``jax_rl/tpu/``),
    without ``__init__.py`` / ``__main__.py`` and ``__pycache__``."""
    out = set()
    for pkg in CODE_PACKAGES:
        for p in (root / pkg).rglob("*.py"):
            if "__pycache__" in p.parts or p.name in ("__init__.py", "__main__.py"):
                continue
            out.add(p.relative_to(root).as_posix())
        for d in (root / pkg).rglob("__init__.py"):
            if d.parent != root / pkg:
                out.add(d.parent.relative_to(root).as_posix() + "/")
    return out


def _resolve(token: str, folder: str, modules: set[str], root: Path) -> set[str]:
    """The modules a path token written in ``folder``'s part of a map names: ``folder/token`` itself, else every
    module of ``folder``'s subtree whose path ends with ``/token`` (a description may name a nested module by its
    short path). Empty when it names no module (then ``token`` is unknown unless it exists as a non-code file)."""
    import posixpath

    full = posixpath.normpath(posixpath.join(folder, token)) + ("/" if token.endswith("/") else "")
    if full in modules:
        return {full}
    return {m for m in modules if m.startswith(folder) and ("/" + m).endswith("/" + token.lstrip("./"))}


def _exists_anywhere(token: str, folder: str, modules: set[str], root: Path) -> bool:
    """Whether a token that names no module of its folder still names something: a file or folder under its
    folder or the root, or, for a package (``x/``), a code package elsewhere (a description's cross-reference,
    ``shared with compile/``). A file name must be its folder's: ``tpu/``'s ``chips.py`` is not ``jax_rl/chips.py``."""
    bare = token.lstrip("./")
    return ((root / folder / token).exists() or (root / token).exists()
            or (token.endswith("/") and any(("/" + m).endswith("/" + bare) for m in modules)))


def design_layout_block(text: str) -> str:
    """The indented code block of design.md's ``## 4. Layout`` section."""
    section = text.split("## 4. Layout", 1)[1].split("\n## ", 1)[0]
    return "\n".join(ln for ln in section.splitlines() if ln.startswith("    ") or not ln.strip())


def check_layout_map(block: str, root: Path = ROOT) -> tuple[list[str], list[str]]:
    """(modules the layout block leaves out, path tokens in it that name no module or file), sorted.

    The block is a tree: an entry line starts before column 20 (``    jax_rl/``, ``      config/  ...``); a name
    ending in ``/`` opens a folder for the lines indented under it; a line starting further right continues the
    entry above. Every ``x.py`` / ``x/`` token of an entry and its continuation lines is read in the entry's folder
    (the entry itself when it is a folder)."""
    modules = code_modules(root)
    named: set[str] = set()
    unknown: list[str] = []
    stack: list[tuple[int, str]] = []  # (indent, folder path)
    folder = ""
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent < 20:
            while stack and stack[-1][0] >= indent:
                stack.pop()
            parent = stack[-1][1] if stack else ""
            first = line.split()[0]
            folder = parent + first if first.endswith("/") else parent
            if first.endswith("/"):
                stack.append((indent, folder))
        for token in _PATH_TOKEN.findall(_CODE_SPAN.sub(lambda m: m.group(0).strip("`"), line)):
            hit = _resolve(token, folder, modules, root)
            if hit:
                named |= hit
            elif folder.startswith(CODE_PACKAGES) and not _exists_anywhere(token, folder, modules, root):
                unknown.append(f"{folder}{token}")
    return sorted(modules - named), sorted(set(unknown))


def package_maps(root: Path = ROOT) -> dict[str, str]:
    """Each package ``__init__`` docstring that is a module map: it names (as ``x.py``, ``x/`` or a dotted
    ``pkg.x``) at least two of its package's own modules. Keyed by the package's path (``jax_rl/learner/``)."""
    import ast

    out = {}
    for pkg in CODE_PACKAGES:
        for init in sorted((root / pkg).rglob("__init__.py")):
            doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
            folder = init.parent.relative_to(root).as_posix() + "/"
            own = _own_modules(code_modules(root), folder)
            dotted = folder.rstrip("/").replace("/", ".")
            hits = [m for m in own if _names_module(doc, m, folder, dotted)]
            if len(hits) >= 2:
                out[folder] = doc
    return out


def _own_modules(modules: set[str], folder: str) -> list[str]:
    """The modules and packages directly in ``folder`` (not the package itself, not deeper ones)."""
    return [m for m in modules if m.startswith(folder) and m != folder and "/" not in m[len(folder):].rstrip("/")]


def _names_module(doc: str, module: str, folder: str, dotted: str) -> bool:
    """Whether a docstring names ``module`` (a child of ``folder``) by file name or dotted path."""
    name = module[len(folder):].rstrip("/").removesuffix(".py")
    return bool(re.search(rf"(?<![\w.]){re.escape(name)}(\.py\b|/)", doc)
                or re.search(rf"{re.escape(dotted)}\.{re.escape(name)}\b", doc))


def check_package_map(folder: str, doc: str, root: Path = ROOT) -> tuple[list[str], list[str]]:
    """(the package's direct modules its ``__init__`` map leaves out, ``x.py`` tokens and ``:mod:`` targets in it
    that name no module), sorted."""
    modules = code_modules(root)
    dotted = folder.rstrip("/").replace("/", ".")
    own = sorted(_own_modules(modules, folder))
    missing = [m for m in own if not _names_module(doc, m, folder, dotted)]
    unknown = []
    for m in re.finditer(r"(?<![\w./-])([a-z_][a-z0-9_]*\.py)\b", doc):  # a bare file name: a sibling's
        token = m.group(1)
        if re.search(r"\w's\s*`*$", doc[:m.start()]):  # another project's file (MaxText's ``train_compile.py``)
            continue
        if not _resolve(token, folder, modules, root) and not (root / token).exists():
            unknown.append(folder + token)
    for target in re.findall(r":mod:`~?([\w.]+)`", doc):
        path = target.replace(".", "/")
        if f"{path}.py" not in modules and f"{path}/" not in modules and path not in CODE_PACKAGES:
            unknown.append(target)
    return missing, sorted(set(unknown))


def test_layout_map_checker_finds_a_missing_and_an_unknown_module(tmp_path):
    for f in ("jax_rl/cli.py", "jax_rl/learner/__init__.py", "jax_rl/learner/sft.py", "jax_rl/learner/spec.py",
              "jax_rl/learner/correction/__init__.py", "jax_rl/learner/correction/old_logits/__init__.py",
              "jax_rl/learner/correction/old_logits/store.py", "rollout/__init__.py", "rollout/pages.py"):
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("", encoding="utf-8")
    block = ("    jax_rl/\n      cli.py              the CLI\n      learner/            sft.py (SFT), gone.py\n"
             "        correction/       old_logits/ (store.py)\n    rollout/\n      pages.py            pages\n")
    assert check_layout_map(block, tmp_path) == (["jax_rl/learner/spec.py"], ["jax_rl/learner/gone.py"])
    doc = "- :mod:`jax_rl.learner.sft`: SFT.\n- ``correction/``: pi_prox; ``old.py`` and :mod:`jax_rl.learner.nope`."
    assert check_package_map("jax_rl/learner/", doc, tmp_path) == (
        ["jax_rl/learner/spec.py"], ["jax_rl.learner.nope", "jax_rl/learner/old.py"])


def test_design_layout_names_every_module_and_only_modules():
    missing, unknown = check_layout_map(design_layout_block((ROOT / "docs" / "design.md").read_text(encoding="utf-8")))
    assert not missing and not unknown, (
        "docs/design.md §4 Layout is out of date with the tree:\n"
        + "".join(f"  not in the layout: {m}\n" for m in missing)
        + "".join(f"  in the layout but not in the tree: {u}\n" for u in unknown))


def test_design_layout_names_every_shipped_config():
    block = design_layout_block((ROOT / "docs" / "design.md").read_text(encoding="utf-8"))
    entry = block.split("configs/", 1)[1].split("\n    jax_rl/", 1)[0]
    named = set(re.findall(r"\b(\w+)(?:\.yaml)?\b", entry))
    missing = sorted(p.stem for p in (ROOT / "configs").glob("*.yaml") if p.stem not in named)
    assert not missing, f"docs/design.md §4 Layout's configs/ entry leaves out {missing}"


def test_package_init_maps_name_every_module_and_only_modules():
    maps = package_maps()
    assert "jax_rl/learner/" in maps and "rollout/engine/" in maps
    problems = []
    for folder, doc in maps.items():
        missing, unknown = check_package_map(folder, doc)
        problems += [f"  {folder}__init__.py leaves out {m}" for m in missing]
        problems += [f"  {folder}__init__.py names {u}, which is not in the tree" for u in unknown]
    assert not problems, "package module maps out of date:\n" + "\n".join(problems)


# ------------------------------------------------------------------------------------------
# the import order, stated once (docs/design.md §4.1 Import order), against tests/test_structure.py's graph
# ------------------------------------------------------------------------------------------


def import_layers(text: str) -> dict[str, int]:
    """design.md §4.1's layers: module prefix -> layer number (1 = the top, imports the most)."""
    section = text.split("### 4.1 Import order", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    out = {}
    for m in re.finditer(r"^ {4}(\d+) +(.+)$", section, re.M):
        for prefix in m.group(2).split():
            out[prefix] = int(m.group(1))
    return out


def _layer(module: str, layers: dict[str, int]) -> int | None:
    """The layer of a module: an entry ``x`` names module ``x`` alone, ``x.*`` names ``x`` and everything under
    it; the longest matching entry wins (``rollout.envs.*`` over ``rollout.*``)."""
    hits = [p for p in layers if module == p.removesuffix(".*")
            or (p.endswith(".*") and module.startswith(p[:-1]))]
    return layers[max(hits, key=len)] if hits else None


def import_order_violations(graph: dict[str, set[str]], layers: dict[str, int],
                            empty_packages: set[str]) -> tuple[list[str], list[str]]:
    """(modules no layer names, ``a (layer i) imports b (layer j)`` for each edge to a higher layer), sorted.
    An edge to a package whose ``__init__`` imports nothing (``empty_packages``) is no dependency."""
    unplaced = sorted(m for m in graph if _layer(m, layers) is None)
    up = []
    for a, deps in graph.items():
        la = _layer(a, layers)
        for b in deps:
            lb = _layer(b, layers)
            if la is not None and lb is not None and lb < la and b not in empty_packages:
                up.append(f"{a} (layer {la}) imports {b} (layer {lb})")
    return unplaced, sorted(up)


def test_import_order_checker_flags_an_upward_edge_and_an_unplaced_module():
    layers = import_layers("### 4.1 Import order\n\n    1  jax_rl.cli\n    2  jax_rl.learner.*\n"
                           "    3  jax_rl.config.* rollout.envs.* jax_rl\n")
    graph = {"jax_rl.cli": {"jax_rl.learner"}, "jax_rl.learner.sft": {"rollout.envs.base", "rollout"},
             "jax_rl.config.run": {"jax_rl.learner.sft"}, "rollout": set(), "rollout.envs.base": set(),
             "jax_rl.new": set(), "jax_rl": set()}
    assert import_order_violations(graph, layers, {"rollout"}) == (
        ["jax_rl.new", "rollout"], ["jax_rl.config.run (layer 3) imports jax_rl.learner.sft (layer 2)"])


def test_import_order_holds():
    from tests.test_structure import _modules, import_graph

    layers = import_layers((ROOT / "docs" / "design.md").read_text(encoding="utf-8"))
    graph = import_graph()
    empty = {m for m, p in _modules().items() if p.name == "__init__.py" and not graph.get(m)}
    unplaced, upward = import_order_violations(graph, layers, empty)
    unplaced = [m for m in unplaced if m not in empty]
    assert not unplaced and not upward, (
        "docs/design.md §4.1 Import order does not hold for the tree:\n"
        + "".join(f"  in no layer: {m}\n" for m in unplaced) + "".join(f"  upward: {u}\n" for u in upward))


def test_extending_page_names_files_and_tests_that_exist():
    """docs/extending.md's code spans that are repository paths (``jax_rl/...``, ``tests/...::test_x``) exist:
    the page is the map a contributor follows, so a moved module or renamed test fails here."""
    text = (ROOT / "docs" / "extending.md").read_text(encoding="utf-8")
    bad = []
    for span in re.findall(r"`([^`\s]+)`", text):
        path, _, test = span.partition("::")
        if not re.match(r"^(jax_rl|rollout|tests|bench|configs|docs)/", path):
            continue
        if not (any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()):
            bad.append(span)
        elif test and not re.search(rf"^def {re.escape(test.split('::')[-1])}\(", (ROOT / path).read_text(), re.M):
            bad.append(span)
    assert not bad, "docs/extending.md names paths or tests that do not exist: " + ", ".join(sorted(set(bad)))
