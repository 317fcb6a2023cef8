"""Every relative link in a tracked Markdown file leads somewhere: the file or folder exists, and a `#anchor` names
a heading (or an explicit `id`/`name` anchor) of the page it points into, slugged as GitHub slugs headings.

Links to other sites (`https:`, `mailto:` ...) are not followed; links inside code (fenced blocks, `inline code`)
are not links. A broken link that its file's owner has not fixed yet is listed in KNOWN with that owner, so the
test stays honest: it fails on any other broken link, and on a KNOWN entry that is no longer broken.
"""

from __future__ import annotations

import re
import subprocess
import unicodedata
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from urllib.parse import unquote

REPO = Path(__file__).resolve().parents[2]

# (file, link as written) -> who fixes it. Empty when every link holds.
KNOWN: dict[tuple[str, str], str] = {}

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+[^>]*(?:name|id)\s*=\s*\"([^\"]+)\"", re.IGNORECASE)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def tracked() -> list[str]:
    """The repository's tracked files (git), relative to its root; every file on disk when git cannot say."""
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, check=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return [str(p.relative_to(REPO)) for p in REPO.rglob("*") if p.is_file() and ".git" not in p.parts]
    return [name for name in out.decode().split("\0") if name]


def outside_code(text: str, blank_spans: bool = True) -> Iterator[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks, inline code spans blanked unless told."""
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), 1):
        opened = FENCE.match(line)
        if fence is not None:
            if opened and opened.group(1)[0] == fence[0] and len(opened.group(1)) >= len(fence):
                fence = None
            continue
        if opened:
            fence = opened.group(1)
            continue
        yield number, INLINE_CODE.sub(lambda m: " " * len(m.group(0)), line) if blank_spans else line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: markup dropped, lower case, punctuation but `-` and `_` removed,
    spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    text = re.sub(r"(\*+)(.+?)\1", r"\2", text)
    kept = "".join(c for c in text.lower() if c in " -_" or unicodedata.category(c)[0] in "LNM")
    return kept.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    """Every anchor of a Markdown page: its headings' slugs (a repeated one gets -1, -2 ...) and explicit anchors."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    text = path.read_text(encoding="utf-8")
    for _, line in outside_code(text, blank_spans=False):  # a heading's code text is part of its slug
        out.update(HTML_ANCHOR.findall(line))
        found = HEADING.match(line)
        if not found:
            continue
        base = slug(found.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def links(text: str) -> Iterator[tuple[int, str]]:
    """(line number, target) of every inline link, image and reference definition outside code."""
    for number, line in outside_code(text):
        for target in LINK.findall(line):
            yield number, target
        if found := REFERENCE.match(line):
            yield number, found.group(1)


def broken(source: str, target: str, files: frozenset[str]) -> str | None:
    """Why `target`, written in tracked file `source`, leads nowhere; None when it holds (or is not ours to check)."""
    if not target or SCHEME.match(target) or target.startswith("//"):
        return None
    path_part, _, anchor = target.partition("#")
    path_part = unquote(path_part.split("?")[0])
    if path_part:
        base = REPO if path_part.startswith("/") else (REPO / source).parent
        resolved = (base / path_part.lstrip("/")).resolve()
        try:
            name = str(resolved.relative_to(REPO))
        except ValueError:
            return "points outside the repository"
        if name not in files and not any(f.startswith(name.rstrip("/") + "/") for f in files) and name != ".":
            return "no such file or folder"
    else:
        resolved = REPO / source
    is_page = resolved.suffix.lower() == ".md" and resolved.is_file()
    if anchor and is_page and unquote(anchor) not in anchors(resolved):
        return f"no heading or anchor #{anchor} in {resolved.relative_to(REPO)}"
    return None


def all_broken() -> dict[tuple[str, str], str]:
    files = frozenset(tracked())
    out: dict[tuple[str, str], str] = {}
    for source in sorted(f for f in files if f.lower().endswith(".md")):
        path = REPO / source
        if not path.is_file():  # deleted in the working tree, not yet committed
            continue
        for number, target in links(path.read_text(encoding="utf-8")):
            if (why := broken(source, target, files)) is not None:
                out[(source, target)] = f"{source}:{number}: ({target}) {why}"
    return out


def test_every_relative_link_and_anchor_in_a_tracked_markdown_file_leads_somewhere() -> None:
    found = all_broken()
    new = [why for key, why in sorted(found.items()) if key not in KNOWN]
    assert new == [], "broken links:\n" + "\n".join(new)


def test_every_known_broken_link_is_still_broken() -> None:
    """A fixed link leaves KNOWN in the same commit."""
    found = all_broken()
    assert [f"{key} ({owner})" for key, owner in KNOWN.items() if key not in found] == []


def test_slugs_follow_github() -> None:
    assert slug("Tracing (OpenTelemetry)") == "tracing-opentelemetry"
    assert slug("Multi-turn: conversations stay where their KV is (`decider: session-affinity`)") == (
        "multi-turn-conversations-stay-where-their-kv-is-decider-session-affinity"
    )
    assert slug("The legs' client (`leg_client`)") == "the-legs-client-leg_client"
    assert slug("**Bold** and [a link](x.md) — dash") == "bold-and-a-link--dash"
    assert slug("GPU check: 2 × H100") == "gpu-check-2--h100"


def test_repeated_headings_code_and_other_sites_are_handled(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# A\n## A\n```\n# not a heading\n[x](nowhere.md)\n```\n`[y](nowhere.md)` [z](https://x.io/#q)\n")
    assert anchors(page) == {"a", "a-1"}
    assert list(links(page.read_text())) == [(7, "https://x.io/#q")]
    coded = tmp_path / "coded.md"
    coded.write_text('## The GPU check (`make gpu-check`)\n<a id="kept"></a>\n')
    assert anchors(coded) == {"the-gpu-check-make-gpu-check", "kept"}
    files = frozenset({"README.md", "docs/a.md"})
    assert broken("docs/a.md", "../README.md", files) is None
    assert broken("docs/a.md", "b.md", files) == "no such file or folder"
    assert broken("docs/a.md", "../../x.md", files) == "points outside the repository"
    assert broken("README.md", "https://example.com/x", files) is None
