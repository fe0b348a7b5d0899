"""docs/http-api.md's request-field table stays whole and true (issue 18: "a test per row").

Every field a generation body defines, and every field refused by name
(``UNHONOURED``), has a row; every row names at least one test, and every
test it names exists.
"""

from __future__ import annotations

import re
from pathlib import Path

from helios.server.protocol import UNHONOURED, UNHONOURED_STREAM_OPTIONS, ChatBody, CompletionBody

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests" / "server"
TABLE = re.compile(r"<!-- field-table:start -->\n(.*?)<!-- field-table:end -->", re.S)
NAMED_TEST = re.compile(r"`([\w]+\.py)::(test_\w+)`")


def _rows() -> list[list[str]]:
    text = (REPO / "docs" / "http-api.md").read_text()
    table = TABLE.search(text)
    assert table, "docs/http-api.md lost its field table markers"
    lines = [line for line in table.group(1).splitlines() if line.startswith("|")][2:]  # less header and rule
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines]


def test_every_row_names_tests_that_exist():
    for field, _, _, _, tests in _rows():
        named = NAMED_TEST.findall(tests)
        assert named, f"row {field} names no test"
        for file, test in named:
            source = TESTS / file
            assert source.is_file(), f"row {field}: no tests/server/{file}"
            assert re.search(rf"^def {test}\(", source.read_text(), re.M), f"row {field}: no {file}::{test}"


def test_every_field_the_server_knows_has_a_row():
    listed = {name for row in _rows() for name in re.findall(r"`([\w.]+)`", row[0])}
    known = set(CompletionBody.model_fields) | set(ChatBody.model_fields) | set(UNHONOURED)
    known |= {f"stream_options.{name}" for name in ("include_usage", *UNHONOURED_STREAM_OPTIONS)}
    known.discard("stream_options")  # listed by its two fields
    assert known - listed == set(), "fields missing from docs/http-api.md's table"
