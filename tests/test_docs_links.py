"""Every relative link and image in README.md and docs/**/*.md points at a file that exists,
and every ``#anchor`` names a heading of its page, slugged the way GitHub slugs headings.

Links inside code (fenced blocks, inline code) are text, not links, and are not checked;
web addresses are not fetched (the tests run offline).
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

from helpers import REPO_ROOT

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
# [text](target) and ![alt](target); the target up to a space (an optional "title") or ')'.
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
# A reference definition, `[label]: target`, on a line of its own.
DEFINITION = re.compile(r"^ {0,3}\[([^\]]+)\]:\s*<?([^\s>]+)>?")
# A reference link's use, [text][label] or ![alt][label].
REFERENCE = re.compile(r"\]\[([^\]]+)\]")
INLINE_CODE = re.compile(r"(`+).+?\1")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: markup dropped, lower case, every character but
    letters, digits, marks, '_', '-' and spaces removed, spaces turned into '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").replace("*", "")
    kept = (c for c in text.lower() if c in " -_" or unicodedata.category(c)[0] in "LMN")
    return "".join(kept).replace(" ", "-")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def anchors(path: Path) -> set[str]:
    """The anchors of a page's headings; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if match:
            base = slug(match[2])
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(page: Path) -> list[str]:
    """Each relative link of ``page`` whose file or heading does not exist, as 'line: target',
    and each reference link whose label the page does not define."""
    broken = []
    lines = [(n, INLINE_CODE.sub("", line)) for n, line in prose_lines(page.read_text("utf-8"))]
    labels = {m[1].lower() for _, prose in lines if (m := DEFINITION.match(prose))}
    for number, prose in lines:
        for label in REFERENCE.findall(prose):
            if label.lower() not in labels:
                broken.append(f"{number}: [{label}] (no such reference)")
        definition = DEFINITION.match(prose)
        for target in LINK.findall(prose) + ([definition[2]] if definition else []):
            if not target or re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, mailto:, ...
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{number}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{number}: {target} (no such heading)")
    return broken


def pages() -> list[Path]:
    return [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_links_resolve(page: Path) -> None:
    assert broken_links(page) == []


def test_slug_matches_github() -> None:
    # Anchors GitHub gives these headings (read off rendered pages of this repository).
    assert slug("Heads and K/V heads: what do fewer K/V heads cost and buy?") == (
        "heads-and-kv-heads-what-do-fewer-kv-heads-cost-and-buy"
    )
    assert slug("en→de, seed 1234") == "ende-seed-1234"
    assert slug("MHA → MLA, the recipe checkpoint") == "mha--mla-the-recipe-checkpoint"
    assert slug("Long-context decoding: what the head designs buy (CPU)") == (
        "long-context-decoding-what-the-head-designs-buy-cpu"
    )
    assert slug("The `attention_view.yaml` [config](x.md)") == "the-attention_viewyaml-config"


def test_a_missing_file_and_heading_are_found(tmp_path: Path) -> None:
    (tmp_path / "b.md").write_text("# Top\n\n## Same\n\n## Same\n")
    page = tmp_path / "a.md"
    page.write_text(
        "[ok](b.md#same-1) [ok](#here) [web](https://x.org/y) `[code](gone.md)`\n"
        "# Here\n"
        "[gone](c.md) ![img](c.png) [no heading](b.md#same-2) [ref][R] [ref][nowhere]\n"
        "[r]: d.md\n"
        "```\n[in a block](gone.md)\n```\n"
    )
    assert broken_links(page) == [
        "3: [nowhere] (no such reference)",
        "3: c.md (no such file)",
        "3: c.png (no such file)",
        "3: b.md#same-2 (no such heading)",
        "4: d.md (no such file)",
    ]
