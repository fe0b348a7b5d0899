"""benchmarks/live_schedule.py's command line (issue 20, item 4): no server is started here."""

from __future__ import annotations

import pytest

from benchmarks import live_schedule


def test_trust_catalog_without_a_catalog_is_one_error_line_and_exit_2(monkeypatch, capsys):
    def serve(*args, **kwargs):
        raise AssertionError("refused arguments started a server")

    monkeypatch.setattr(live_schedule, "serve", serve)
    assert live_schedule.main(["--trust-catalog"]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and lines[0].startswith("error: --trust-catalog needs --catalog"), err


class _Started(Exception):
    pass


@pytest.mark.parametrize("trust", [False, True])
def test_the_catalog_and_trust_reach_flare_run(monkeypatch, trust):
    seen = []

    def popen(command, **kwargs):
        seen.append(command)
        raise _Started

    monkeypatch.setattr(live_schedule.subprocess, "Popen", popen)
    with pytest.raises(_Started):
        live_schedule.serve(8731, 1, ["prompts_by_due=0"], "/some/catalog", trust)
    command = seen[0]
    assert command[command.index("run") + 1] == "/some/catalog"
    assert ("--trust-catalog" in command) is trust
    assert command[command.index("--scheduler-choice") + 1] == "prompts_by_due=0"
