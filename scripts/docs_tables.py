"""Write the measured tables of ``docs/*.md`` from ``benchmarks/results/``, so the docs never
drift from the results files (``tests/unit/test_docs_tables.py`` fails when they differ).

A generated part of a doc sits between two marker comments; everything between them is
replaced:

    <!-- generated: benchmarks/results/gpu_check.md section="Speed" table=1 -->
    ...
    <!-- end generated -->

The first marker names a results file (``.md``, relative to the repository) and, optionally,
which part of it to take:

- ``section="TEXT"``: the lines under the first heading whose text starts with TEXT, up to the
  next heading of the same or a higher level (the heading itself is left out);
- ``table=N``: only the N-th table (1-based) of the file, or of that section.

Without either, the whole file is taken, less its ``#`` title. Headings in what is taken are
moved two levels down, below the doc's own. The part starts with a line that names its source.

    .venv/bin/python scripts/docs_tables.py            # rewrite the docs in place
    .venv/bin/python scripts/docs_tables.py --check    # exit 1 and name the docs that differ
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MARKER = re.compile(r"^<!-- generated: (?P<source>\S+)(?P<options>[^>]*?) -->\n"
                    r"(?P<body>.*?)"
                    r"^<!-- end generated -->$", re.MULTILINE | re.DOTALL)
OPTION = re.compile(r'(\w+)=(?:"([^"]*)"|(\S+))')
HEADING = re.compile(r"^(#+)\s+(.*)$")


class DocsTablesError(ValueError):
    """A marker names a file, section or table that is not there."""


def _section(lines: list[str], start: str, source: str) -> list[str]:
    for i, line in enumerate(lines):
        found = HEADING.match(line)
        if found and found[2].startswith(start):
            level = len(found[1])
            end = next((j for j in range(i + 1, len(lines))
                        if (h := HEADING.match(lines[j])) and len(h[1]) <= level), len(lines))
            return lines[i + 1:end]
    raise DocsTablesError(f"{source}: no heading starts with {start!r}")


def _table(lines: list[str], n: int, source: str) -> list[str]:
    tables: list[list[str]] = []
    previous = False
    for line in lines:
        is_row = line.startswith("|")
        if is_row and not previous:
            tables.append([])
        if is_row:
            tables[-1].append(line)
        previous = is_row
    if not 1 <= n <= len(tables):
        raise DocsTablesError(f"{source}: no table {n} (it has {len(tables)})")
    return tables[n - 1]


def _trim(lines: list[str]) -> list[str]:
    while lines and not lines[0].strip():
        lines = lines[1:]
    while lines and not lines[-1].strip():
        lines = lines[:-1]
    return lines


def part(source: str, options: str, root: Path = ROOT) -> str:
    """The text a marker stands for: the chosen part of ``source``, with its source line."""
    path = root / source
    if not path.is_file():
        raise DocsTablesError(f"{source}: no such results file")
    opts = {m[1]: m[2] if m[2] is not None else m[3] for m in OPTION.finditer(options)}
    unknown = set(opts) - {"section", "table"}
    if unknown:
        raise DocsTablesError(f"{source}: unknown marker option(s) {', '.join(sorted(unknown))}")
    lines = path.read_text().splitlines()
    if "section" in opts:
        lines = _section(lines, opts["section"], source)
    elif lines and lines[0].startswith("# "):
        lines = lines[1:]
    if "table" in opts:
        lines = _table(lines, int(opts["table"]), source)
    lines = [f"##{line}" if HEADING.match(line) else line for line in _trim(lines)]
    return "\n".join([f"*Generated from `{source}` by `scripts/docs_tables.py`.*", "", *lines]) + "\n"


def render(text: str, root: Path = ROOT) -> str:
    """``text`` (a doc) with every generated part written afresh from its results file."""
    def fill(m: re.Match) -> str:
        head = m[0].splitlines()[0]
        return f"{head}\n{part(m['source'], m['options'], root)}<!-- end generated -->"
    return MARKER.sub(fill, text)


def docs(root: Path = ROOT) -> list[Path]:
    """The docs that have generated parts."""
    return sorted(p for p in (root / "docs").glob("*.md") if MARKER.search(p.read_text()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a doc differs")
    args = ap.parse_args(argv)
    stale = []
    for path in docs():
        text = path.read_text()
        new = render(text)
        if new != text:
            stale.append(path.relative_to(ROOT))
            if not args.check:
                path.write_text(new)
    verb = "differ from benchmarks/results (run scripts/docs_tables.py)" if args.check else "rewritten"
    for path in stale:
        print(f"{path}: {verb}")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
