"""Docstrings, comments and docs cite docs/DESIGN.md and docs/FORMATS.md by section name
("DESIGN.md, *Moving chunks*"); every such citation must name a heading of that file or a bold
term in it, so renaming a section without fixing its citations fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CITATION = re.compile(r"\b(DESIGN|FORMATS)\.md,?\s*\(?\s*[\"*]([^\"*\n]{3,80})[\"*]")


def _names(doc: Path) -> list[str]:
    text = doc.read_text()
    heads = [m.group(1).strip() for m in re.finditer(r"^#+\s+(.+)$", text, re.M)]
    bold = [m.group(1).strip() for m in re.finditer(r"\*\*([^*\n]+)\*\*", text)]
    return [re.sub(r"[`*]", "", n).lower() for n in heads + bold]


def _sources() -> list[Path]:
    files: list[Path] = []
    for sub in ("bdn", "tests", "bench", "examples", "docs"):
        files += [p for p in (ROOT / sub).rglob("*") if p.suffix in (".py", ".md") and p.is_file()]
    return files + [ROOT / "README.md", ROOT / "BENCHMARKS.md"]


def test_every_cited_section_exists() -> None:
    names = {d: _names(ROOT / "docs" / f"{d}.md") for d in ("DESIGN", "FORMATS")}
    bad = []
    for path in _sources():
        for m in CITATION.finditer(path.read_text(errors="replace")):
            doc, cited = m.group(1), re.sub(r"[`*]", "", m.group(2)).strip().rstrip(".,;:").lower()
            if not any(n.startswith(cited) or cited.startswith(n) for n in names[doc] if n):
                bad.append(f"{path.relative_to(ROOT)}: {doc}.md, {m.group(2)!r}")
    assert not bad, "citations of sections that do not exist:\n" + "\n".join(bad)
