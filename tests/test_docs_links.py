"""Links in the README, docs/, bench/ and the recipes' READMEs resolve: every relative link names a file that
exists, every #anchor names a heading or an `<a id>` of its target page, and every figure's source row in
bench/RESULTS.md gives a date, a device and a command. Reads text only, so it runs in well under a second."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "RESULTS.md"
PAGES = sorted([ROOT / "README.md", ROOT / "bench" / "README.md", RESULTS, *ROOT.glob("bench/history/*.md"),
                *ROOT.glob("docs/*.md"),
                *ROOT.glob("examples/README.md"), *ROOT.glob("examples/*/README.md")])

FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
EXPLICIT_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
# a device named the way RESULTS.md names them: a GPU model or the CPU it ran on
DEVICE = re.compile(r"H100|H200|\bCPU\b|vCPU", re.I)
# a command: a code span that runs a script, a polyrl command or a make target
COMMAND = re.compile(r"`[^`]*(?:python3? |bench/|examples/|polyrl |torchrun |make |pytest )[^`]*`")


def _prose(text: str) -> str:
    """The text with fenced blocks and inline code blanked, line count kept (a `](` or `#` inside code is no link)."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return INLINE_CODE.sub("``", text)


def _slug(heading: str) -> str:
    """GitHub's heading anchor: inline code and link targets reduced to their text, lower case, punctuation but '-'
    and '_' dropped, spaces to '-'."""
    h = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    h = h.replace("`", "").strip().lower()
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = page.read_text(encoding="utf-8")
    found = set(EXPLICIT_ANCHOR.findall(text))
    seen: dict[str, int] = {}
    for m in HEADING.finditer(FENCE.sub("", text)):
        s = _slug(m.group(2))
        n = seen.get(s, 0)
        seen[s] = n + 1
        found.add(s if n == 0 else f"{s}-{n}")
    return found


def links(page: Path) -> list[tuple[int, str]]:
    text = _prose(page.read_text(encoding="utf-8"))
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in LINK.finditer(text)]


def _local(target: str) -> bool:
    return not re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target)  # http:, https:, mailto: are not checked (no network)


def results_row(anchor: str) -> str:
    """RESULTS.md from `<a id="anchor">` to the next explicit anchor, with the headings above it that enclose it (a
    date or a device often sits in the section's heading)."""
    text = RESULTS.read_text(encoding="utf-8")
    start = text.index(f'<a id="{anchor}"></a>')
    nxt = EXPLICIT_ANCHOR.search(text, start + 1)
    row = text[start:nxt.start() if nxt else len(text)]
    enclosing, level = [], 7
    for m in reversed(list(HEADING.finditer(text[:start]))):
        if len(m.group(1)) < level:
            enclosing.append(m.group(0))
            level = len(m.group(1))
    return "\n".join(enclosing) + "\n" + row


def test_the_pages_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert {"README.md", "docs/benchmarks.md", "examples/lora/README.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_and_anchors_resolve(page):
    broken = []
    for line, target in links(page):
        if not _local(target):
            continue
        path, _, frag = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(ROOT)}:{line} -> {target}"
        if not dest.exists():
            broken.append(f"{where}: no such file")
        elif frag and dest.suffix == ".md" and frag not in anchors(dest):
            broken.append(f"{where}: no heading or <a id> '{frag}' in {dest.relative_to(ROOT)}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_cited_results_row_gives_date_device_and_command():
    cited: dict[str, list[str]] = {}
    for page in PAGES:
        for line, target in links(page):
            path, _, frag = target.partition("#")
            if frag and path and (page.parent / path).resolve() == RESULTS.resolve():
                cited.setdefault(frag, []).append(f"{page.relative_to(ROOT)}:{line}")
    assert len(cited) >= 10, "the README and docs cite bench/RESULTS.md rows by anchor"
    have = anchors(RESULTS)
    missing = [f"{a} (cited at {', '.join(w)})" for a, w in cited.items() if a not in have]
    assert not missing, "RESULTS.md anchors that do not exist:\n" + "\n".join(missing)
    lacking = []
    for a, where in sorted(cited.items()):
        if f'<a id="{a}"></a>' not in RESULTS.read_text(encoding="utf-8"):
            lacking.append(f"{a}: cite rows by an explicit <a id> anchor, not a heading slug ({', '.join(where)})")
            continue
        row = results_row(a)
        for what, pattern in (("date", DATE), ("device", DEVICE), ("command", COMMAND)):
            if not pattern.search(row):
                lacking.append(f"{a}: no {what} in its row (cited at {', '.join(where)})")
    assert not lacking, "\n".join(lacking)


def test_the_checker_catches_a_broken_link_and_a_missing_anchor(tmp_path):
    page = tmp_path / "p.md"
    (tmp_path / "there.md").write_text("# A `code` heading, with punctuation!\n<a id=\"row-1\"></a>\n", encoding="utf-8")
    page.write_text("[a](there.md#a-code-heading-with-punctuation) [b](there.md#row-1) [c](missing.md) "
                    "[d](there.md#nope) `[e](ignored.md)` [f](https://example.com/x)\n", encoding="utf-8")
    got = [(t, t.partition("#")[0] and (tmp_path / t.partition("#")[0]).exists(),
            t.partition("#")[2] in anchors(tmp_path / "there.md"))
           for _, t in links(page) if _local(t)]
    assert got == [("there.md#a-code-heading-with-punctuation", True, True), ("there.md#row-1", True, True),
                   ("missing.md", False, False), ("there.md#nope", True, False)]
