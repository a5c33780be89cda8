"""The documentation's links: every relative link in README.md, docs/*.md and benchmarks/results/**/README.md
names a file or folder of the repository, and every #anchor into a Markdown file names one of its headings
(GitHub's slugs). README.md stays a front page: under 300 lines."""

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
# [text](target) and ![alt](target); the text may hold one level of brackets ([`x`][y] is not used here)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^)\s]*)(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+).*?\1")
EXTERNAL = re.compile(r"^(https?:|mailto:)", re.IGNORECASE)


def doc_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "benchmarks" / "results").glob("**/README.md"))]
    return [path for path in files if path.is_file()]


def prose_lines(text: str):
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text, lowercased, punctuation dropped but - and _, spaces to -."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # a link in a heading: its text
    text = re.sub(r"<[^>]+>", "", text)                        # inline HTML
    text = text.replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")   # GitHub numbers repeated headings
    return frozenset(found)


def links(path: Path):
    """(line number, target) of every Markdown link outside code."""
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        for match in LINK.finditer(CODE_SPAN.sub("", line)):
            yield number, match.group(1).strip("<>")


def test_docs_exist():
    names = {path.relative_to(ROOT).as_posix() for path in doc_files()}
    assert "README.md" in names
    assert any(name.startswith("docs/") for name in names)


def test_slug_follows_github():
    assert slug("A 4-bit target on CPU: the GGUF's own weights (`quantize_target`)") == \
        "a-4-bit-target-on-cpu-the-ggufs-own-weights-quantize_target"
    assert slug("Benchmark: `pacer-bench`") == "benchmark-pacer-bench"
    assert slug("Quickstart (fresh machine)") == "quickstart-fresh-machine"


@pytest.mark.parametrize("path", doc_files(), ids=lambda path: path.relative_to(ROOT).as_posix())
def test_links_resolve(path):
    broken = []
    for number, target in links(path):
        if not target or EXTERNAL.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        if file_part:
            resolved = (ROOT / file_part.lstrip("/")) if file_part.startswith("/") else (path.parent / file_part)
            resolved = resolved.resolve()
            if not resolved.exists():
                broken.append(f"line {number}: {target}: no such file")
                continue
            if ROOT not in resolved.parents and resolved != ROOT:
                broken.append(f"line {number}: {target}: outside the repository")
                continue
        else:
            resolved = path
        if anchor and resolved.is_file() and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"line {number}: {target}: no heading #{anchor} in {resolved.relative_to(ROOT)}")
    assert not broken, f"{path.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) < 300, f"README.md has {len(lines)} lines; move details to docs/"


def test_results_are_data_and_the_readme_a_front_page():
    """benchmarks/ holds results, not code (the analyses are tested pacer-bench commands); the README stays a front page
    (its figures in docs/results.md)."""
    import subprocess

    tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files", "benchmarks"], capture_output=True, text=True).stdout
    if not tracked:  # not a git checkout (an sdist): read the tree
        tracked = "\n".join(p.relative_to(ROOT).as_posix() for p in (ROOT / "benchmarks").rglob("*"))
    assert [p for p in tracked.split() if p.endswith(".py")] == []
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) < 200
