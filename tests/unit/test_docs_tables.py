"""The docs never drift from the results: every generated part of ``docs/*.md`` is what
``scripts/docs_tables.py`` writes from ``benchmarks/results/`` now, and the figures in the
README's table are in the results file it names."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("docs_tables", ROOT / "scripts" / "docs_tables.py")
docs_tables = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(docs_tables)


def test_the_measured_docs_have_generated_parts():
    names = {p.name for p in docs_tables.docs()}
    assert {"performance.md", "model-zoo.md"} <= names, names


@pytest.mark.parametrize("doc", docs_tables.docs(), ids=lambda p: p.name)
def test_generated_parts_equal_the_results_files(doc):
    text = doc.read_text()
    assert docs_tables.render(text) == text, (
        f"{doc.relative_to(ROOT)} differs from benchmarks/results: run "
        ".venv/bin/python scripts/docs_tables.py and commit the docs")


def test_readme_figures_come_from_their_results_file():
    readme = (ROOT / "README.md").read_text()
    found = re.search(r"<!-- figures from (\S+) -->\n(.*?)<!-- end figures -->", readme, re.DOTALL)
    assert found, "README.md has no figures block"
    source = (ROOT / found[1]).read_text()
    rows = [line for line in found[2].splitlines() if line.startswith("|")]
    numbers = [n for line in rows for n in re.findall(r"\d+\.\d+", line)]
    assert numbers
    missing = [n for n in numbers if not re.search(rf"(?<![\d.]){re.escape(n)}(?![\d])", source)]
    assert missing == [], f"README figures not in {found[1]}: {missing}"


def test_a_marker_takes_the_section_or_table_it_names(tmp_path):
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "r.md").write_text("# Title\n\nintro\n\n## Speed\n\n| a |\n|---|\n| 1 |\n\nnote\n\n"
                                  "| b |\n|---|\n| 2 |\n\n## Other\n\n| c |\n")
    doc = ("text\n<!-- generated: benchmarks/results/r.md section=\"Speed\" table=2 -->\nold\n"
           "<!-- end generated -->\nmore\n<!-- generated: benchmarks/results/r.md -->\n"
           "<!-- end generated -->\n")
    out = docs_tables.render(doc, tmp_path)
    assert "| b |\n|---|\n| 2 |\n<!-- end generated -->\nmore" in out
    assert "old" not in out and "| a |" not in out.split("more")[0]
    whole = out.split("more")[1]
    assert "Title" not in whole and "\n#### Speed\n" in whole  # two levels down
    assert docs_tables.render(out, tmp_path) == out
    with pytest.raises(docs_tables.DocsTablesError):
        docs_tables.render(doc.replace("Speed", "Nothing"), tmp_path)
