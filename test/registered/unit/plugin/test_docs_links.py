"""Every relative link in README.md and docs/*.md names a file or folder that exists (the
README is a landing page: its evidence lives behind these links). Web links and anchors
are not checked. Runs in both venvs."""

import re
from pathlib import Path
from typing import List

REPO = Path(__file__).resolve().parents[4]
# [text](target) and [text](target "title"); images too.
_LINK = re.compile(r"\[[^\]]*\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")


def broken_links(markdown: str, base: Path) -> List[str]:
    """The relative link targets in ``markdown`` that do not exist under ``base``."""
    broken = []
    for target in _LINK.findall(markdown):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a web or mail link, or an anchor in the same page
        path = target.split("#", 1)[0]
        if not (base / path).exists():
            broken.append(target)
    return broken


def test_a_missing_target_is_reported_and_web_links_and_anchors_are_not(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "status.md").write_text("x")
    page = (
        "[ok](docs/status.md) [anchor](docs/status.md#gpu) [gone](docs/statuss.md) "
        "[web](https://example.com/x) [self](#links) [titled](docs/nope.md \"t\")"
    )
    assert broken_links(page, tmp_path) == ["docs/statuss.md", "docs/nope.md"]


def test_every_relative_link_in_the_readme_and_docs_resolves() -> None:
    pages = [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))
    assert len(pages) > 5
    broken = {
        str(page.relative_to(REPO)): links
        for page in pages
        if (links := broken_links(page.read_text(encoding="utf-8"), page.parent))
    }
    assert broken == {}
