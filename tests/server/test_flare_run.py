"""``flare run`` end to end: a real server process on loopback over a captured slice of the bundled catalog.

The catalog is the cached capture of ``tests/helios/tiny_catalog.py`` (a few
programs of the bundled model), so the server's warm-up loads seconds of
programs rather than minutes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from helios import launch
from helios.launch import LaunchError, RunOptions
from helios.sim.files import load_catalog

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helios"))
from server_process import start_server, wait_ready  # noqa: E402
from tiny_catalog import cache_folder, tiny_catalog_path  # noqa: E402

from helios.ops import kernels  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FLARE = [sys.executable, "-m", "helios.cli"]


@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    catalog = tiny_catalog_path(cache_folder(request.config, tmp_path_factory))
    log_path = tmp_path_factory.mktemp("flare-run") / "server.log"
    estimates = log_path.with_name("estimates.yaml")
    process = start_server([*FLARE, "run", str(catalog), "--threads", "1", "--dump-estimates", str(estimates)],
                           log_path, cwd=REPO)
    try:
        base = wait_ready(process, log_path, name="flare run", timeout_s=300.0)  # a safety net: a loaded 2-core machine starts slowly
        yield base, process, log_path
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus sample's values over series matching ``labels``."""
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{name}(?:\{{(.*)\}})? (\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            total += float(match.group(2))
    return total


def test_flare_run_serves_completions_and_chat_streamed_and_not_and_metrics_move(server):
    base, _, _ = server
    before = httpx.get(f"{base}/metrics").text
    with httpx.Client(base_url=base, timeout=60.0) as client:
        plain = client.post("/v1/completions", json={"model": "flare-tiny", "prompt": "Hello there", "max_tokens": 8,
                                                     "temperature": 0}).json()
        chunks = []
        with client.stream("POST", "/v1/chat/completions", json={
            "model": "flare-tiny", "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 10,
            "stream": True, "stream_options": {"include_usage": True},
        }) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[len("data: "):]))
        models = client.get("/v1/models").json()
    after = httpx.get(f"{base}/metrics").text

    assert plain["object"] == "text_completion" and plain["choices"][0]["finish_reason"] in ("length", "stop")
    assert 1 <= plain["usage"]["completion_tokens"] <= 8
    assert isinstance(plain["choices"][0]["text"], str)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
    assert finishes[-1] in ("length", "stop") and all(f is None for f in finishes[:-1])
    assert chunks[-1]["usage"]["completion_tokens"] >= 1
    assert [m["id"] for m in models["data"]] == ["flare-tiny"]
    executions = metric(after, "flare_scheduler_executions_total") - metric(before, "flare_scheduler_executions_total")
    prompts = sum(metric(after, "flare_scheduler_executions_total", graph_kind=kind)
                  - metric(before, "flare_scheduler_executions_total", graph_kind=kind) for kind in ("prefill", "mixed"))
    assert prompts >= 2 and executions >= prompts + 1  # each prompt ran, and output was decoded after them
    assert metric(after, "flare_kv_pages_free") > 0 and metric(after, "flare_requests_running") == 0


def test_flare_run_logs_each_startup_step(server):
    _, _, log_path = server
    text = log_path.read_text()
    for step in ("load catalog", "allocate state", "warm up", "ready on http://127.0.0.1"):
        assert step in text, f"startup step {step!r} missing from the log:\n{text[-2000:]}"


def test_sigterm_drains_and_exits_cleanly_writing_the_learned_estimates(server, tmp_path):
    base, process, log_path = server
    reply = httpx.post(f"{base}/v1/completions", json={"model": "flare-tiny", "prompt": "Estimates, please",
                                                        "max_tokens": 12, "temperature": 0}, timeout=60.0)
    assert reply.status_code == 200
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0  # a drained shutdown is a clean exit, not death by the signal
    text = log_path.read_text()
    assert "draining" in text and "engine stopped" in text and "learned durations written" in text, text[-2000:]

    estimates = log_path.with_name("estimates.yaml")
    catalog = load_catalog(estimates)
    kinds = {graph.descriptor.kind.value for graph in catalog.graphs}
    assert "prefill" in kinds or "mixed" in kinds, kinds  # the prompts ran, so a prompt program was measured
    assert all(graph.duration_ns > 0 for graph in catalog.graphs) and catalog.request_slots == 4
    assert set(g.descriptor.id for g in catalog.graphs) <= set(tiny_programs())
    trace = tmp_path / "trace.yaml"
    trace.write_text("requests:\n  - {prompt_tokens: 40, max_tokens: 8}\n  - {prompt_tokens: 10, max_tokens: 4}\n")
    simulated = subprocess.run([*FLARE, "simulate", str(estimates), str(trace), "--json"], cwd=REPO,
                               capture_output=True, text=True, timeout=120)
    assert simulated.returncode == 0, simulated.stderr
    assert all(r["finished_ms"] is not None for r in json.loads(simulated.stdout)["requests"].values())


def tiny_programs() -> tuple[str, ...]:
    from tiny_catalog import PROGRAMS

    return PROGRAMS


def test_C6_Y3_a_speculative_width_the_catalog_lacks_is_one_line_and_exit_2(request, tmp_path_factory):
    catalog = tiny_catalog_path(cache_folder(request.config, tmp_path_factory))
    result = subprocess.run([*FLARE, "run", str(catalog), "--speculative-width", "7", "--port", "0"],
                            cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    # flare-tiny verifies at most 4 positions per row; the line names the widths there are, 1 always among them
    assert len(errors) == 1 and "--speculative-width 7" in errors[0] and "widths are 1, 2" in errors[0], result.stderr


@pytest.mark.parametrize("name, value, error", [
    pytest.param("FLARE_LINEAR_NATIVE_ROWS", "4", "FLARE_LINEAR_NATIVE_ROWS='4': expected a row count from 16 to 256",
                 marks=pytest.mark.skipif(kernels.active() != "native", reason="the row bound is the native kernel's")),
    pytest.param("FLARE_LINEAR_CHUNK_ROWS", "65", "FLARE_LINEAR_CHUNK_ROWS='65': expected a row count from 0 to 64",
                 marks=pytest.mark.skipif(kernels.active() != "native", reason="the loop order is the native kernel's")),
    pytest.param("FLARE_LINEAR_ROW_ROWS", "x", "FLARE_LINEAR_ROW_ROWS='x': expected a row count from 0 to 64",
                 marks=pytest.mark.skipif(kernels.active() != "native", reason="the loop order is the native kernel's")),
    pytest.param("FLARE_LINEAR_PACK", "yes", "FLARE_LINEAR_PACK='yes' is not 0 or 1",
                 marks=pytest.mark.skipif(kernels.active() != "native", reason="packing is the native kernel's")),
    pytest.param("FLARE_LINEAR_AHEAD_FROM", "300", "FLARE_LINEAR_AHEAD_FROM='300': expected a row count from 0 to 256",
                 marks=pytest.mark.skipif(kernels.active() != "native", reason="asking ahead is the native kernel's")),
    ("FLARE_COMPILED_CALL", "sometimes", "FLARE_COMPILED_CALL='sometimes' is not one of released, held"),
], ids=["linear row bound", "linear loop order", "linear row order", "linear packing", "linear ahead",
        "compiled call"])
def test_a_bad_setting_in_the_environment_is_one_line_and_exit_2(request, tmp_path_factory, name, value, error):
    catalog = tiny_catalog_path(cache_folder(request.config, tmp_path_factory))
    result = subprocess.run([*FLARE, "run", str(catalog), "--port", "0", "--threads", "1"], cwd=REPO,
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "COLUMNS": "200", name: value})
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {error}"], result.stderr


@pytest.mark.parametrize("flags, complaint", [
    ({"alpha": 0.0}, "> 0"),
    ({"speculation": "sometimes"}, "off, fixed, adaptive"),
    ({"policy": "fastest"}, "balanced, throughput"),
    ({"threads": 0}, "--threads"),
    ({"speculative_width": 0}, "--speculative-width must be >= 1"),
    ({"dump_estimates": Path("/nonexistent-folder/estimates.yaml")}, "does not exist"),
    ({"choices": ("prefill_defers_decode=2",)}, "FIELD=0 or FIELD=1"),
    ({"choices": ("decode_age_price=1",)}, "token_rate_by_value, prompt_chunk_share, prefill_defers_decode"),
    ({"choices": ("prefill_defers_decode",)}, "FIELD=0 or FIELD=1"),
    ({"terminal_value": -1.0}, "--scheduler-terminal-value must be a finite number >= 0"),
    ({"terminal_age_price": float("nan")}, "--scheduler-terminal-age-price must be a finite number >= 0"),
    ({"adaptive_floor": "lazy"}, "--adaptive-floor 'lazy' is unknown; use one of plain, draft"),
    ({"adaptive_floor": "plain", "speculation": "fixed"}, "--adaptive-floor applies to --speculation adaptive only"),
    ({"adaptive_floor": "draft", "speculation": "off"}, "--adaptive-floor applies to --speculation adaptive only"),
])
def test_run_options_refuse_bad_flags_naming_the_allowed_values(flags, complaint):
    with pytest.raises(LaunchError, match=re.escape(complaint)):
        RunOptions(**flags)


def test_scheduler_choices_reach_the_policy_after_the_preset():
    options = RunOptions(policy="throughput", choices=("prefill_defers_decode=1", "token_rate_by_value=1"))
    policy = options.policy_config()
    assert (policy.prefill_defers_decode, policy.token_rate_by_value, policy.decode_age_price) == (1, 1, 0.0)
    assert RunOptions(choices=("prompt_chunk_share=0",)).policy_config().prompt_chunk_share == 0


def test_the_adaptive_floor_flag_reaches_the_engine():
    class Device:
        manifest = type("M", (), {"device": {"kind": "cpu"}})()
    assert RunOptions().engine_config(Device()).adaptive_floor == "plain"  # the engine's default
    assert RunOptions(adaptive_floor="draft").engine_config(Device()).adaptive_floor == "draft"


def test_terminal_and_reuse_flags_reach_the_policy_and_the_engine():
    """P6's prices and prefix reuse are flags that do something: they land in the scheduler's policy and the
    engine's configuration (what the scheduler and engine then do with them is tested there)."""
    class Device:
        manifest = type("M", (), {"device": {"kind": "cpu"}})()
    default = RunOptions().engine_config(Device())
    chosen = RunOptions(terminal_value=7.0, terminal_age_price=0.25, prefix_reuse=False).engine_config(Device())
    assert default.prefix_reuse and not chosen.prefix_reuse  # on unless --no-prefix-reuse
    assert (chosen.policy.terminal_value, chosen.policy.terminal_age_price) == (7.0, 0.25)
    assert (default.policy.terminal_value, default.policy.terminal_age_price) != (7.0, 0.25)


def test_prefix_reuse_on_a_catalog_without_a_store_is_refused():
    """A flag the catalog cannot honour is refused, not accepted and ignored."""
    class NoStore:
        descriptors, checkpoint_rows, path = (), 0, Path("/catalogs/plain")
    RunOptions().check_selection(NoStore())  # by default such a catalog is served without reuse
    RunOptions(prefix_reuse=False).check_selection(NoStore())
    with pytest.raises(LaunchError, match=r"--prefix-reuse: catalog /catalogs/plain keeps no checkpoint store"):
        RunOptions(prefix_reuse=True).check_selection(NoStore())


def test_a_bad_flag_is_one_line_on_stderr_and_exit_2(tmp_path):
    result = subprocess.run([*FLARE, "run", str(tmp_path), "--mtp-adaptive-verification-alpha", "0"], cwd=REPO,
                            capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--mtp-adaptive-verification-alpha" in lines[0], result.stderr


def test_two_servers_starting_at_once_capture_the_bundled_catalog_once(tmp_path, monkeypatch):
    captures = []

    def fake_capture(folder):
        captures.append(folder)
        time.sleep(0.2)  # the second starter must wait on the lock, not start its own capture
        folder.mkdir(parents=True)
        (folder / "catalog.yaml").write_text("format_version: 1\n")

    monkeypatch.setattr(launch, "_capture_bundled", fake_capture)
    with ThreadPoolExecutor(2) as pool:
        folders = list(pool.map(lambda _: launch.bundled_catalog(tmp_path), range(2)))
    assert len(captures) == 1 and folders[0] == folders[1] == captures[0]
    assert folders[0].name.startswith("flare-tiny-")


def test_only_the_bundled_catalog_is_trusted_without_the_flag(tmp_path, monkeypatch):
    """flare run trusts the catalog it captured itself into its cache (compiled programs are native
    code); a catalog named on the command line needs --trust-catalog."""
    trusted = []
    monkeypatch.setattr(launch, "bundled_catalog", lambda: tmp_path / "bundled")
    monkeypatch.setattr(launch, "_load", lambda folder, trust: trusted.append((folder.name, trust)) or object())
    monkeypatch.setattr(launch, "check_servable", lambda catalog: None)
    monkeypatch.setattr(launch.RunOptions, "check_selection", lambda self, catalog: None)
    for options in (launch.RunOptions(), launch.RunOptions(catalog=tmp_path / "named"),
                    launch.RunOptions(catalog=tmp_path / "named", trust_catalog=True)):
        launch.open_catalog(options)
    assert trusted == [("bundled", True), ("named", False), ("named", True)]


def _fake_ignition(root: Path) -> Path:
    for name, text in {"recipes/flare-tiny.yaml": "model: x\n", "models/bundled/flare-tiny/target/w.bin": "w",
                       "models/qwen3.py": "A = 1\n", "capture/build.py": "B = 1\n",
                       "capacity/plan.py": "C = 1\n", "capture/__pycache__/build.cpython-311.pyc": "junk"}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_bundled_cache_digest_follows_the_capture_source_not_the_install_folder(tmp_path):
    """A code change that alters the programs within one format version must capture afresh: the cache
    folder's digest covers model code, capture and capacity planning as well as recipe and weights."""
    first = _fake_ignition(tmp_path / "a" / "ignition")
    digest = launch._bundle_digest(first)
    assert launch._bundle_digest(_fake_ignition(tmp_path / "b" / "ignition")) == digest  # where it lies: no
    (first / "capture/__pycache__/build.cpython-311.pyc").write_text("other junk")
    assert launch._bundle_digest(first) == digest  # byte-code caches: no
    for changed in ("models/qwen3.py", "capture/build.py", "capacity/plan.py", "recipes/flare-tiny.yaml",
                    "models/bundled/flare-tiny/target/w.bin"):
        before = (first / changed).read_text()
        (first / changed).write_text(before + "# edit\n")
        assert launch._bundle_digest(first) != digest, changed
        (first / changed).write_text(before)
    assert launch._bundle_digest(first) == digest


def test_a_second_server_cannot_claim_an_address_bound_but_not_yet_listening(tmp_path, monkeypatch):
    """SO_REUSEADDR lets two sockets bind one port while neither listens: the second start must still be
    one clear error at step 0, and the address is free again once the first listener closes."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    first = launch.bind_listener("127.0.0.1", port)
    try:
        with pytest.raises(LaunchError, match=f"--port {port}: another server is starting"):
            launch.bind_listener("127.0.0.1", port)
    finally:
        first.close()
    launch.bind_listener("127.0.0.1", port).close()
