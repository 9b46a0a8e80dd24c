"""Every Python file of the pack passes pyflakes: no undefined names (which dead code left
after a removal hides from the tests), no unused imports or variables. A line marked
``# noqa`` (an import kept for its side effect) is exempt. Committed results and docs name no
machine's folders."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from pyflakes import api as pyflakes_api
from pyflakes.reporter import Reporter

REPO_ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted([REPO_ROOT / "__init__.py",
                  *(REPO_ROOT / "compile_core").rglob("*.py"),
                  *(REPO_ROOT / "nodes").glob("*.py"),
                  *(REPO_ROOT / "benchmarks").glob("*.py"),
                  *(REPO_ROOT / "scripts").glob("*.py")])


class _Collect(Reporter):
    def __init__(self):
        self.problems: list[str] = []

    def flake(self, message):
        line = Path(message.filename).read_text().splitlines()[message.lineno - 1]
        if "# noqa" not in line:
            self.problems.append(str(message))

    def syntaxError(self, filename, msg, lineno, offset, text):  # noqa: N802 - pyflakes API
        self.problems.append(f"{filename}:{lineno}: {msg}")

    def unexpectedError(self, filename, msg):  # noqa: N802 - pyflakes API
        self.problems.append(f"{filename}: {msg}")


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_pyflakes_clean(path):
    reporter = _Collect()
    pyflakes_api.checkPath(str(path), reporter)
    assert reporter.problems == []


# an absolute folder of a machine (a home, a checkout, a temporary folder), as a results file
# written with a full interpreter or output path would carry it
MACHINE_PATH = re.compile(r"(?<![\w.:/])/(?:home|root|work|Users|tmp|var/folders)/[\w.-]+")
PUBLISHED = sorted([REPO_ROOT / "README.md", *(REPO_ROOT / "docs").glob("*.md"),
                    *(REPO_ROOT / "benchmarks" / "results").glob("*.md"),
                    *(REPO_ROOT / "benchmarks" / "results").glob("*.json")])


@pytest.mark.parametrize("path", PUBLISHED, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_published_files_name_no_machine_folders(path):
    found = MACHINE_PATH.findall(path.read_text(encoding="utf-8"))
    assert found == [], found[:5]
