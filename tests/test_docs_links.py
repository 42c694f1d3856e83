"""The documentation's relative links resolve, and the config reference names every key.

Every Markdown link or image in README.md, CONTRIBUTING.md and docs/ that is not a URL must point
at a file in the repository, and a `#anchor` at a heading of that file (GitHub's slug rule).
Links inside fenced code blocks and inline code are not links.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from deploy.config.serve_config import ServeConfig

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").rglob("*.md")])
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`[^`]*`")


def _prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) outside fenced code blocks, with inline code removed."""
    lines, fenced = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, INLINE_CODE.sub("", line)))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    counts: dict[str, int] = {}
    for _, line in _prose_lines(path):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(1))
            seen = counts.get(base, 0)
            found.add(base if seen == 0 else f"{base}-{seen}")
            counts[base] = seen + 1
    return found


def relative_links(path: Path) -> list[tuple[int, str]]:
    links = []
    for number, line in _prose_lines(path):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            links.append((number, target))
    return links


def test_the_documents_exist():
    names = {p.relative_to(ROOT).as_posix() for p in DOCS}
    assert {"README.md", "CONTRIBUTING.md", "docs/index.md", "docs/architecture.md"} <= names


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(path: Path):
    broken = []
    for number, target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            broken.append(f"{path.name}:{number}: {target} (no such file)")
        elif not resolved.is_relative_to(ROOT):
            broken.append(f"{path.name}:{number}: {target} (outside the repository)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{path.name}:{number}: {target} (no heading #{anchor})")
    assert not broken, "\n".join(broken)


def test_the_link_checker_sees_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](#title) [bad](missing.md) [gone](#nowhere)\n`[code](x.md)`\n")
    assert relative_links(page) == [(3, "#title"), (3, "missing.md"), (3, "#nowhere")]
    assert anchors(page) == {"title"}


def test_slug_follows_github():
    assert slug("Engine throughput, GPU") == "engine-throughput-gpu"
    assert slug("3. The benchmark") == "3-the-benchmark"
    assert slug("The `kv_aware` policy") == "the-kv_aware-policy"


def test_the_serving_guide_names_every_config_key():
    guide = (ROOT / "docs" / "guides" / "serving.md").read_text(encoding="utf-8")
    missing = []
    for top in dataclasses.fields(ServeConfig):
        section = top.metadata.get("section")
        keys = [top.name] if section is None else [f.name for f in dataclasses.fields(section)]
        for key in keys:
            if f"`{key}`" not in guide:
                missing.append(top.name if section is None else f"{top.name}.{key}")
    assert not missing, f"docs/guides/serving.md does not describe: {missing}"
