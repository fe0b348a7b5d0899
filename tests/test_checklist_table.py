"""docs/structures.md's checklist table names real code and real tests, and every id a test names.

The table maps each implemented checklist id to the function that is its home
and the tests that check it. A rename or a move that leaves the table behind
fails here, and so does a new id-named test whose id the table lacks.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "docs" / "structures.md"
ID = re.compile(r"^[A-Z]\d+$")
CODE = re.compile(r"`((?:helios|ignition|flare_contract|tests)/[\w/]+\.py)(?::([\w.]+))?`")
TEST = re.compile(r"`(tests/[\w/]+\.py)::(test_\w+)`")


def rows() -> dict[str, str]:
    """Checklist id -> the rest of its table row."""
    found = {}
    section = TABLE.read_text().split("## Checklist ids", 1)[1]
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and ID.match(cells[0]):
            found[cells[0]] = cells[1] + " | " + cells[2]
    return found


def defined_names(path: Path) -> set[str]:
    """Top-level functions, classes and assignments, and ``Class.member`` for class members."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                names.update(f"{node.name}.{n.name}" for n in node.body
                             if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def test_every_home_and_test_in_the_checklist_table_exists():
    table = rows()
    assert len(table) > 60
    missing = []
    for checklist_id, text in table.items():
        for path, name in CODE.findall(text):
            file = ROOT / path
            if not file.is_file():
                missing.append(f"{checklist_id}: {path}")
            elif name and name not in defined_names(file):
                missing.append(f"{checklist_id}: {path}:{name}")
        tests = TEST.findall(text)
        if checklist_id != "U1":  # no test names U1; its row says which test covers it
            assert tests, f"{checklist_id} names no test"
        for path, name in tests:
            file = ROOT / path
            if not file.is_file() or name not in defined_names(file):
                missing.append(f"{checklist_id}: {path}::{name}")
    assert not missing, missing


def test_every_id_a_test_is_named_after_has_a_row():
    named = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        for name in re.findall(r"def (test_\w+)", path.read_text()):
            parts = name.split("_")[1:]
            for part in parts:
                if not ID.match(part):
                    break
                named.add(part)
    absent = sorted(named - set(rows()))
    assert not absent, f"ids named by tests but missing from docs/structures.md: {absent}"
