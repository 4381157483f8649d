"""The docs: no dead relative link in README.md or docs/*.md, README stays a front page, and the
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
    assert n <= 300, f"README.md has {n} lines; keep it a front page (<= 300) and move detail into docs/"
    targets = set(markdown_links(text))
    for doc in ("docs/config.md", "docs/usage.md", "docs/correction.md", "docs/tpu.md",
                "docs/performance.md", "docs/reliability.md", "docs/paper_repro.md", "docs/design.md"):
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
