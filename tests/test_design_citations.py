"""Every design citation in the project ("docs/design.md §4.2", or the older "DESIGN §4") names a section that
docs/design.md has, and nothing cites a design file outside the project. Torch-free."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
CITATION = re.compile(r"(?:DESIGN|design\.md) (§\d+(?:\.\d+)*(?:(?:, | and )§\d+(?:\.\d+)*)*)")
SECTION = re.compile(r"^#{2,4} (\d+(?:\.\d+)*)\.? ", re.MULTILINE)


def _sources() -> list[Path]:
    files = [*(ROOT / "hchain_viz").rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "docs").glob("*.md"),
             *(ROOT / "notebooks").rglob("*.ipynb"), ROOT / "README.md"]
    return [f for f in files if f.is_file() and ".ipynb_checkpoints" not in f.parts]


def test_design_has_numbered_sections_one_to_twelve():
    sections = set(SECTION.findall(DESIGN.read_text(encoding="utf-8")))
    assert {str(n) for n in range(1, 13)} <= sections, sorted(sections)


def test_every_design_citation_names_a_section_that_exists():
    sections = set(SECTION.findall(DESIGN.read_text(encoding="utf-8")))
    missing = []
    for path in _sources():
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for group in CITATION.findall(line):
                missing += [f"{path.relative_to(ROOT)}:{n}: §{s}" for s in re.findall(r"§([\d.]+)", group)
                            if s.rstrip(".") not in sections]
    assert not missing, "citations of sections docs/design.md lacks:\n" + "\n".join(missing)


def test_nothing_cites_a_design_file_outside_the_project():
    bad = [str(p.relative_to(ROOT)) for p in _sources()
           if p != Path(__file__).resolve() and re.search(r"/work/shared|DESIGN\.md", p.read_text(encoding="utf-8"))]
    assert not bad, bad
