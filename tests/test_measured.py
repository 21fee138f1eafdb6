"""docs/measured.md holds the current figures: it stays short, and every reference to one of its
sections (or of its log's), from code or docs, names a heading that exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = {name: ROOT / "docs" / name for name in ("measured.md", "measured-log.md")}
MAX_LINES = 400
REFERENCE = re.compile(r"(measured(?:-log)?\.md)#([\w-]+)")
SEARCHED = ("compile_service", "client", "kernels", "proto", "devtools", "benchmark", "tests", "docs")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(line.lstrip("#")) for line in page.read_text().splitlines() if re.match(r"#{1,6} ", line)}


def references() -> list[tuple[str, str, str]]:
    """(file, page, anchor) for every `measured.md#<anchor>` in the repository's code and docs; a link
    inside a page to its own heading, `(#<anchor>)`, counts as one to that page."""
    files = [ROOT / "README.md"] + [p for d in SEARCHED for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".md")]
    found = []
    for path in files:
        text = path.read_text()
        found += [(str(path.relative_to(ROOT)), page, anchor) for page, anchor in REFERENCE.findall(text)]
        if path.name in PAGES:
            found += [(str(path.relative_to(ROOT)), path.name, anchor) for anchor in re.findall(r"\]\(#([\w-]+)\)", text)]
    return found


def test_the_slug_follows_githubs_rule():
    assert slug("TileLang's own API through the daemon") == "tilelangs-own-api-through-the-daemon"
    assert slug("Start-up from `serve`") == "start-up-from-serve"
    assert slug("Compile cost by commit (issue 28)") == "compile-cost-by-commit-issue-28"


def test_measured_md_holds_at_most_400_lines():
    lines = PAGES["measured.md"].read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"docs/measured.md has {len(lines)} lines; at most {MAX_LINES}: history goes to docs/measured-log.md"


def test_every_reference_to_a_section_of_measured_md_names_a_heading_it_has():
    refs = references()
    assert any(page == "measured.md" and not f.startswith("docs/measured") for f, page, _ in refs), "no reference found: is the pattern right?"
    headings = {page: anchors(path) for page, path in PAGES.items()}
    missing = [f"{f}: {page}#{anchor}" for f, page, anchor in refs if anchor not in headings[page]]
    assert not missing, "references to headings that do not exist:\n" + "\n".join(missing)


def test_code_cites_measured_md_by_anchor_not_by_section_title():
    cited_by_title = [str(p.relative_to(ROOT)) for d in SEARCHED for p in (ROOT / d).rglob("*.py") if re.search(r"measured\.md, (section|\")", p.read_text())]
    assert not cited_by_title, f"cite docs/measured.md#<anchor> instead of a section's title: {cited_by_title}"
