"""helios.scheduler is pure Python with no wall clock (DESIGN.md; spec "Planning and the execution queue")."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import helios.scheduler

PACKAGE = Path(helios.scheduler.__file__).parent


def test_importing_the_scheduler_does_not_import_torch():
    code = "import sys, helios.scheduler, helios.scheduler.core; print('torch' in sys.modules)"
    root = PACKAGE.parent.parent
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, check=True)
    assert result.stdout.strip() == "False"


def test_no_module_reads_a_clock():
    clock = re.compile(r"\b(time\.(time|monotonic|perf_counter)\w*|datetime|import time\b|from time import)")
    offenders = [p.name for p in PACKAGE.glob("*.py") if clock.search(p.read_text())]
    assert offenders == []
