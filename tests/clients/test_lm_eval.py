"""lm-evaluation-harness against ``flare run`` (issue 18): ``generate_until`` and ``loglikelihood`` tasks through
``local-completions`` with ``--batch_size 4``, on a small task the check writes itself (nothing downloaded).

lm-eval lives in its own virtual environment under the peers cache, never the project's
(``benchmarks/clients/lm_eval_check.py --install`` creates it); without it this test is skipped and says
how to install it. It serves the bundled recipe captured without compilation and with four slots (a
scored-prefill program included), so it needs no AOTInductor build. Full scale only: it takes minutes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "helios"))
from tiny_catalog import source_digest  # noqa: E402

PEERS = Path(os.environ.get("FLARE_PEERS_CACHE", Path.home() / ".cache" / "flare-peers"))


@pytest.mark.slow
def test_lm_eval_generate_until_and_loglikelihood_with_batches_of_four(request, tmp_path_factory, tmp_path):
    if os.environ.get("FLARE_TEST_SCALE") == "ci":
        pytest.skip("full scale only (minutes of lm-eval runs); `make test` without FLARE_TEST_SCALE=ci runs it")
    if not (PEERS / "lm-eval" / "venv" / "bin" / "lm-eval").exists() and not (PEERS / "lm-eval" / "venv" / "bin" / "lm_eval").exists():
        pytest.skip(f"lm-eval is not installed under {PEERS}/lm-eval "
                    "(python benchmarks/clients/lm_eval_check.py --install)")
    cache = getattr(request.config, "cache", None)
    name = f"flare-lm-eval-{source_digest()}"
    home = cache.mkdir(name) if cache is not None else tmp_path_factory.mktemp(name)
    catalog = home / "catalog"
    if not (catalog / "catalog.yaml").is_file():
        subprocess.run([sys.executable, "-m", "ignition.cli", "capture", "flare-tiny", "--out", str(catalog),
                        "--compile", "none", "--drafts", "0", "--concurrency", "4"],
                       cwd=REPO, check=True, capture_output=True, timeout=1200)
    result = subprocess.run([sys.executable, "benchmarks/clients/lm_eval_check.py", "--catalog", str(catalog),
                             "--cache", str(PEERS)], cwd=REPO, capture_output=True, text=True, timeout=1800)
    print("\n" + "\n".join(line for line in result.stdout.splitlines()
                             if line.startswith(("lm-eval", "documents", "requests", "batches"))))
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    assert "lm-eval generate_until check: PASSED" in result.stdout, result.stdout[-2000:]
    assert "lm-eval loglikelihood check: PASSED" in result.stdout, result.stdout[-2000:]
