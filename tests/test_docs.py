"""The README a newcomer reads in two minutes, and an index that lists every page of docs/."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_readme_is_short_and_has_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text) <= 7000, len(text)
    assert "make demo" in text and "make test" in text
    assert "docs/getting-started.md" in text and "docs/index.md" in text
    # every headline figure says whether it was measured or predicted
    table = text[text.index("## Headline figures"):text.index("## Documentation")]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| figure")]
    assert rows and all(("measured" in row) != ("predicted" in row) for row in rows), rows


def test_the_index_lists_every_page_and_every_link_resolves():
    index = (ROOT / "docs" / "index.md").read_text()
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name != "index.md")
    for page in pages:
        assert f"]({page})" in index, page
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#:]+\.md)(?:#[^)]*)?\)", doc.read_text()):
            assert (doc.parent / target).exists(), (doc.name, target)
