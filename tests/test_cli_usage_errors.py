"""Usage errors of both command lines are one ``error:`` line on stderr and exit 2 (flare_contract/cli.py).

Typer frames a usage error (an unknown option, a value of the wrong type, a
missing argument) in a panel of several lines; the house rule for bad input
on a command line is one line naming the problem, exit 2.
"""

from __future__ import annotations

import pytest

from flare_contract.cli import run_app
from helios.cli import app as flare_app
from ignition.cli import app as ignition_app

PROG = {id(flare_app): "flare", id(ignition_app): "ignition"}
CASES = [
    (flare_app, ["run", "--bogus"], ["No such option: --bogus", "flare run --help"]),
    (flare_app, ["run", "--port", "abc"], ["'--port'", "flare run --help"]),
    (flare_app, ["simulate"], ["Missing argument"]),
    (ignition_app, ["plan", "default", "--bogus"], ["No such option: --bogus", "ignition plan --help"]),
    (ignition_app, ["plan"], ["Missing argument 'recipe'"]),
    (ignition_app, ["capture", "default", "--jobs", "many"], ["'--jobs'"]),
]


@pytest.mark.parametrize("app, args, words", CASES, ids=[" ".join(a) for _, a, _ in CASES])
def test_a_usage_error_is_one_line_on_stderr_and_exit_2(app, args, words, capsys):
    with pytest.raises(SystemExit) as exited:
        run_app(app, PROG[id(app)], args)
    out, err = capsys.readouterr()
    assert exited.value.code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert all(word in lines[0] for word in words), lines[0]


def test_help_still_prints_and_exits_0(capsys):
    with pytest.raises(SystemExit) as exited:
        run_app(ignition_app, "ignition", ["plan", "--help"])
    assert exited.value.code == 0 and "Usage" in capsys.readouterr().out


def test_a_bad_kernel_choice_in_the_environment_is_one_line_and_exit_2():
    """``FLARE_OPS_KERNELS`` is read when helios.ops is first imported (a fresh process here): a value
    that names no choice is bad input like a bad flag, not a traceback."""
    import os
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "helios.cli", "run", "/nonexistent"], capture_output=True,
                            text=True, timeout=120, env={**os.environ, "FLARE_OPS_KERNELS": "bogus"})
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-2000:]
    assert lines == ["error: FLARE_OPS_KERNELS='bogus' is not one of auto, native, python"]
