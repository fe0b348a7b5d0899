"""ignition.capture: the catalog writer (issue 2 item 5; C11).

Uses the stand-in source (ignition.capture.stand_in), so these run without the
real model; the real model's round trip is in test_capture_model.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import yaml

from flare_contract.sampling import BIAS_CAPACITY
from helios.catalog.load import load
from ignition.capture import CaptureError, CaptureObserver, StagingError, write_catalog
from ignition.capture.export import export_program
from ignition.capture.stand_in import HIDDEN, StandInProgram, StandInSpec, stand_in_inputs, stand_in_source, stand_in_state
from numerics import assert_close_paths, assert_tokens_match, chain_tolerance, qwen3_tolerance, recorded_decisions


@pytest.fixture
def tokenizer(tmp_path) -> Path:
    path = tmp_path / "tokenizer.json"
    path.write_text('{"model": "stand-in"}')
    return path


class FailAfter(CaptureObserver):
    """Interrupts the capture after ``count`` programs, as a crash or Ctrl-C would."""

    def __init__(self, count: int):
        self.count = count

    def program_done(self, descriptor) -> None:
        self.count -= 1
        if self.count == 0:
            raise KeyboardInterrupt


def test_same_source_gives_the_same_manifest_and_files(tmp_path, tokenizer):
    first = write_catalog(stand_in_source(tokenizer), tmp_path / "a").path
    second = write_catalog(stand_in_source(tokenizer), tmp_path / "b").path
    assert (first / "catalog.yaml").read_bytes() == (second / "catalog.yaml").read_bytes()
    files = sorted(str(p.relative_to(first)) for p in first.rglob("*") if p.is_file())
    assert files == sorted(str(p.relative_to(second)) for p in second.rglob("*") if p.is_file())
    assert all((first / f).read_bytes() == (second / f).read_bytes() for f in files)


def test_parallel_export_writes_the_same_catalog_as_serial(tmp_path, tokenizer):
    """--jobs only changes who exports: every file matches a serial capture byte for byte."""
    serial = write_catalog(stand_in_source(tokenizer), tmp_path / "serial").path
    parallel = write_catalog(stand_in_source(tokenizer), tmp_path / "parallel", jobs=2).path
    files = sorted(str(p.relative_to(serial)) for p in serial.rglob("*") if p.is_file())
    assert files == sorted(str(p.relative_to(parallel)) for p in parallel.rglob("*") if p.is_file())
    assert [f for f in files if (serial / f).read_bytes() != (parallel / f).read_bytes()] == []


def test_C11_manifest_writes_zero_durations_and_no_timestamps(tmp_path, tokenizer):
    graphs = tuple(dataclasses.replace(g, estimated_duration_ns=99) for g in stand_in_source(tokenizer).graphs)
    root = write_catalog(stand_in_source(tokenizer, graphs), tmp_path / "c").path
    raw = yaml.safe_load((root / "catalog.yaml").read_text())
    assert [p["estimated_duration_ns"] for p in raw["programs"]] == [0, 0, 0]
    assert not {"created", "timestamp", "captured_at"} & set(raw)


def test_weights_are_stored_once_and_not_embedded_in_programs(tmp_path, tokenizer):
    source = stand_in_source(tokenizer)
    root = write_catalog(source, tmp_path / "c").path
    assert [p.name for p in (root / "weights").iterdir()] == ["target.safetensors"]
    embed = source.weights["target"]["embed"].numpy().tobytes()
    for program in (root / "programs").iterdir():
        assert embed[:64] not in program.read_bytes(), f"{program.name} embeds the weights"
    manifest = load(root).manifest
    assert all(p.inputs[0].weights == "target" for p in manifest.programs)


def test_state_is_what_programs_mutate(tmp_path, tokenizer):
    manifest = load(write_catalog(stand_in_source(tokenizer), tmp_path / "c").path).manifest
    assert [t.name for t in manifest.state.tensors] == ["pending", "seq_lens", "cache"]
    inputs = {a.name: a for a in manifest.programs[0].inputs}
    assert not inputs["prompt_tokens"].mutated and not inputs["row_slots"].mutated
    assert inputs["cache"].mutated and inputs["pending"].mutated


def test_interrupted_capture_leaves_no_catalog(tmp_path, tokenizer):
    with pytest.raises(KeyboardInterrupt):
        write_catalog(stand_in_source(tokenizer), tmp_path / "c", FailAfter(2))
    assert not (tmp_path / "c").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["tokenizer.json"], "staging folder left behind"


def test_interrupted_recapture_keeps_the_previous_catalog(tmp_path, tokenizer):
    target = write_catalog(stand_in_source(tokenizer), tmp_path / "c").path
    before = (target / "catalog.yaml").read_bytes()
    with pytest.raises(KeyboardInterrupt):
        write_catalog(stand_in_source(tokenizer, seed=1), target, FailAfter(1))
    assert (target / "catalog.yaml").read_bytes() == before
    assert load(target).descriptors


def test_completed_recapture_replaces_the_previous_catalog(tmp_path, tokenizer):
    target = write_catalog(stand_in_source(tokenizer), tmp_path / "c").path
    old = load(target).manifest.weights[0].sha256
    write_catalog(stand_in_source(tokenizer, seed=1), target)
    assert load(target).manifest.weights[0].sha256 != old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "tokenizer.json"]


def test_unwritable_out_is_a_clear_error(tmp_path, tokenizer):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(StagingError, match="is a file, not a folder"):
        write_catalog(stand_in_source(tokenizer), blocker / "c")
    with pytest.raises(StagingError, match="not a folder"):
        write_catalog(stand_in_source(tokenizer), blocker)


def test_a_folder_that_is_not_a_catalog_is_never_replaced(tmp_path, tokenizer):
    precious = tmp_path / "home"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(StagingError, match="is not a catalog"):
        write_catalog(stand_in_source(tokenizer), precious)
    assert (precious / "notes.txt").read_text() == "keep me"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert load(write_catalog(stand_in_source(tokenizer), empty).path).descriptors


@pytest.mark.slow
def test_aoti_catalog_runs_compiled_programs_with_weights_bound_at_load(tmp_path, tokenizer):
    """--compile aoti: one compiled package per program, no weights inside, same results as eager."""
    graphs = tuple(g for g in stand_in_source(tokenizer).graphs if g.id == "decode_b4")
    source = stand_in_source(tokenizer, graphs)
    catalog = load(write_catalog(source, tmp_path / "c", compile="aoti").path, trust=True)  # native code by design
    entry = catalog.entry("decode_b4")
    assert catalog.manifest.compile == "aoti" and entry.compiled_file == "programs/decode_b4.aoti.pt2"
    embed = source.weights["target"]["embed"].numpy().tobytes()
    assert embed[:64] not in (catalog.path / entry.compiled_file).read_bytes(), "weights baked into the package"
    inputs = stand_in_inputs(entry.descriptor)
    compiled_state, eager_state = stand_in_state(), stand_in_state()
    got = catalog.program("decode_b4")(**inputs, **compiled_state)
    want = StandInProgram(0)(source.weights["target"], **inputs, **eager_state)
    # Inductor generates its own kernels: the stand-in's two reductions, reordered.
    tolerance = chain_tolerance(torch.float32, [HIDDEN, HIDDEN])
    assert_close_paths(got["logits"], want[1], tolerance, "logits")
    assert torch.equal(got["tokens"], want[0]) or bool(
        (want[1].gather(-1, got["tokens"][:, None]) >= want[1].max(-1, keepdim=True).values
         - 2 * tolerance * want[1].abs().max()).all()), "tokens differ beyond a near-tie"
    for name, value in eager_state.items():
        assert_close_paths(compiled_state[name], value, tolerance, f"{name} not updated in place like eager")
    assert compiled_state["cache"].abs().sum() > 0


class WritesThroughAView(torch.nn.Module):
    def forward(self, cache, index, value):
        cache[1].index_put_((index,), value)  # a per-layer view of the base cache
        return (value * 2,)


def test_mutation_through_a_view_marks_the_base_input(tmp_path):
    spec = StandInSpec(
        module=WritesThroughAView(),
        example_args=(torch.zeros(2, 4, 3), torch.tensor([1]), torch.ones(1, 3)),
        input_names=("cache", "index", "value"),
        output_names=("doubled",),
        weight_keys=(),
    )
    exported = export_program(spec, tmp_path / "p.pt2", {})
    assert [(a.name, a.mutated) for a in exported.inputs] == [("cache", True), ("index", False), ("value", False)]
    assert exported.outputs[0].shape == (1, 3)


# ---------------------------------------------------------------------------
# The bundled model, end to end: capture -> fresh process under other kernels -> equals eager.
# ---------------------------------------------------------------------------

FRESH_PROCESS_RUNNER = """
import sys, torch
from helios.catalog.load import load
jobs_file, results_file = sys.argv[1:3]
results = []
for job in torch.load(jobs_file):
    catalog, out = load(job["catalog"]), {}
    for program_id, frame in job["frames"].items():
        state = {name: t.clone() for name, t in job["state"].items()}
        outputs = catalog.program(program_id)(**frame, **state)
        caches = [n for n in ("k_cache", "v_cache", "draft_k_cache", "draft_v_cache") if n in state]
        written = {n: job["state"][n] != state[n] for n in caches}
        out[program_id] = {"outputs": outputs, "writes": {n: state[n] for n in ("pending", "seq_lens", "token_counts", "prompt_seen")},
                           "cache": {n: state[n][w] for n, w in written.items()},
                           "cache_where": {n: w.nonzero() for n, w in written.items()}}
    results.append(out)
assert not [m for m in sys.modules if m.startswith("ignition")], "the runtime imported ignition"
print("kernels:", torch.backends.cpu.get_cpu_capability())
torch.save(results, results_file)
"""

# The fresh process runs another CPU kernel choice than this one (vectorised against scalar
# kernels), so the comparison below meets different summation orders on every machine.
OTHER_KERNELS = "default"


def _full_default_catalog(folder: Path) -> Path:
    """The whole default catalog plus the smallest and widest mixed programs (full scale only)."""
    from ignition.capacity import CapacityOptions, plan_capacity
    from ignition.capture.pipeline import model_source
    from ignition.recipes import load_recipe

    recipe = load_recipe("flare-tiny").resolve()
    default = plan_capacity(recipe).graphs
    mixed = [g for g in plan_capacity(recipe, CapacityOptions(mixed_prefill=True)).graphs if g.kind.value == "mixed"]
    source = dataclasses.replace(model_source(recipe, plan_capacity(recipe)), graphs=(*default, mixed[0], mixed[-1]))
    return write_catalog(source, folder).path


def _rows(pattern: tuple, count: int) -> list:
    """``pattern`` repeated to ``count`` rows (programs of any batch capacity get varied rows)."""
    return [pattern[i % len(pattern)] for i in range(count)]


def _frame(entry, state_spec, seq_lens, gen) -> dict[str, torch.Tensor]:
    """Inputs for one program: live rows in shuffled slots, the last row inactive, partial prompts."""
    d = entry.descriptor
    layout = state_spec.layout
    order = [s for s in (2, 0, 3, 1) if s < layout["request_slots"]] + list(range(4, layout["request_slots"]))
    slots = torch.tensor(order[: d.batch_capacity], dtype=torch.int32)
    is_prompt_kind = d.kind.value in ("prefill", "scored_prefill")
    prompt_len = min(d.prefill_capacity, 37)
    lens = [prompt_len] if is_prompt_kind else [d.width] * d.batch_capacity
    if d.kind.value == "mixed":
        lens[0] = prompt_len  # prefill_row 0 (C14)
    if d.batch_capacity > 1 and not (d.kind.value == "mixed" and d.batch_capacity == 2):
        lens[-1] = 0  # an inactive row must write nothing
    if d.ragged:
        lens = [d.width, 1] + [0] * (d.batch_capacity - 2)
    pages = layout["max_pages_per_slot"]
    vocab = 259
    frame = {
        # slots own pages in reverse order: addresses differ from slot-major positions
        "page_table": torch.arange(layout["request_slots"] * pages, dtype=torch.int32).view(-1, pages).flip(0),
        "row_slots": slots,
        "query_lens": torch.tensor(lens, dtype=torch.int32),
        "temperature": torch.tensor(_rows((0.0, 0.8, 0.0, 1.1), d.batch_capacity)),
        "top_k": torch.tensor(_rows((0, 40, 0, 0), d.batch_capacity), dtype=torch.int32),
        "top_p": torch.tensor(_rows((1.0, 0.9, 1.0, 0.95), d.batch_capacity)),
        "seed": torch.tensor(_rows((11, 22, 33, 44), d.batch_capacity), dtype=torch.int64),
        "prefill_row": torch.tensor([0], dtype=torch.int32),
        "prompt_tokens": torch.randint(0, vocab, (max(d.prefill_capacity, 1),), generator=gen),
        "prompt_start": seq_lens[slots[:1].long()].int(),
        "prompt_final": torch.tensor([True]),
        "next_prompt_token": torch.randint(0, vocab, (1,), generator=gen),
        "draft_tokens": torch.randint(0, vocab, (d.batch_capacity, max(d.width - 1, 0)), generator=gen),
        # the sampling controls, active: min-p, penalties over the history, bias rows (some only before a position)
        "min_p": torch.tensor(_rows((0.0, 0.05, 0.0, 0.1), d.batch_capacity)),
        "repetition_penalty": torch.tensor(_rows((1.3, 1.0, 0.8, 1.1), d.batch_capacity)),
        "presence_penalty": torch.tensor(_rows((0.5, 0.0, -0.5, 1.0), d.batch_capacity)),
        "frequency_penalty": torch.tensor(_rows((0.2, 0.4, 0.0, 0.0), d.batch_capacity)),
        "bias_ids": torch.randint(0, vocab, (d.batch_capacity, BIAS_CAPACITY), generator=gen),
        "bias_values": torch.randn(d.batch_capacity, BIAS_CAPACITY, generator=gen) * 5,
        "bias_until": torch.randint(0, 200, (d.batch_capacity, BIAS_CAPACITY), generator=gen).int(),
    }
    names = [a.name for a in entry.inputs if a.weights is None and not a.mutated]
    return {name: frame[name] for name in names}


# At CI scale, one program of each kind and family, as loading each costs a second or two in the
# fresh process: a prompt chunk, a decode batch with an inactive row, a learned query-length
# round, a prefix-limit (ragged) round, a copy round, a speculative mixed frame, a scored prefill.
CI_PROGRAMS = ("prefill_p256", "decode_b4", "spec_b2_d1_w2_p4", "spec_b4_d3_w4_p8_ragged_pl",
               "spec_b2_d1_w2_p4_copy", "mixed_b2_w2_p256_spec", "scored_prefill_p64")


def _job(catalog, gen, only: tuple[str, ...] | None) -> dict:
    """Programs of ``catalog`` (those in ``only``, if given) with a frame each, over one shared starting state."""
    state = catalog.allocate_state()
    state["k_cache"].normal_(generator=gen)
    state["v_cache"].normal_(generator=gen)
    slots = catalog.state.layout["request_slots"]
    state["pending"].copy_(torch.tensor([(17, 101, 250, 3)[i % 4] for i in range(slots)]))  # any slot count
    state["seq_lens"].copy_(torch.tensor([(41, 0, 130, 9)[i % 4] for i in range(slots)], dtype=torch.int32))
    state["token_counts"].copy_(torch.randint(0, 3, state["token_counts"].shape, generator=gen, dtype=torch.int32))
    state["prompt_seen"].copy_(torch.rand(state["prompt_seen"].shape, generator=gen) < 0.2)
    # State programs copy state and sample nothing; their captured programs run in tests/helios/test_state_ops.py.
    frames = {p.id: _frame(p, catalog.state, state["seq_lens"], gen) for p in catalog.manifest.programs
              if (only is None or p.id in only) and p.descriptor.kind.value not in ("snapshot", "restore", "init")}
    return {"catalog": str(catalog.path), "frames": frames, "state": state}


def _eager(program, frame, state) -> dict:
    """An eager twin of the program (tests/helios/tiny_catalog.py) on the same inputs and a copy of the state."""
    state = {name: t.clone() for name, t in state.items()}
    return {"outputs": program(**frame, **state), "state": state}


def test_no_captured_output_shares_storage_with_the_state_or_a_written_input(catalog):
    """The engine's device worker hands a frame's outputs over unread and the control thread reads them
    while the next frame runs (helios.runtime.executor.Executor.call): so no output may live in the state,
    which the next frame writes. The one output allowed to alias an input is a rectangular round's
    ``verified_lens``, the frame's ``query_lens``, which nothing writes (bound row inputs are shared by value,
    ``RowInputCache``)."""
    job = _job(catalog, torch.Generator().manual_seed(3), None)
    state = job["state"]

    def span(t: torch.Tensor) -> tuple[int, int]:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.data_ptr() + storage.nbytes()

    state_spans = {name: span(t) for name, t in state.items()}
    checked = 0
    for program_id, frame in job["frames"].items():
        outputs = catalog.program(program_id)(**frame, **state)
        input_spans = {name: span(t) for name, t in frame.items() if isinstance(t, torch.Tensor) and t.numel()}
        for name, out in outputs.items():
            if not out.numel():
                continue
            start = out.untyped_storage().data_ptr()
            assert not any(lo <= start < hi for lo, hi in state_spans.values()), (program_id, name)
            shared = {n for n, (lo, hi) in input_spans.items() if lo <= start < hi}
            assert shared <= ({"query_lens"} if name == "verified_lens" else set()), (program_id, name, shared)
            checked += 1
    assert checked >= 2 * len(job["frames"])  # every program returns at least its tokens and their counts


@pytest.mark.slow
def test_C1_C14_captured_programs_run_in_a_fresh_process_under_other_kernels_like_eager(catalog, cli_capture,
                                                                                       tmp_path):
    """Every captured kind (prefill, scored prefill, decode, speculative, mixed) loaded in a fresh
    process that imports only helios, and runs the CPU's other kernels, equals the eager model within
    the arithmetic's tolerance, and writes the KV cache exactly where eager does.

    Catalogs: the tests' tiny slice (prefill, decode, every speculative family, mixed) and the CLI
    capture (its scored prefill); at full scale also the whole default catalog."""
    import os
    import subprocess
    import sys

    from tiny_catalog import eager_programs

    ci = os.environ.get("FLARE_TEST_SCALE") == "ci"
    catalogs = [catalog, load(cli_capture.folder)]
    if not ci:
        catalogs.append(load(_full_default_catalog(tmp_path / "default")))
    gen = torch.Generator().manual_seed(7)
    jobs = [_job(c, gen, CI_PROGRAMS if ci else None) for c in catalogs]
    torch.save(jobs, tmp_path / "jobs.pt")
    runner = tmp_path / "runner.py"
    runner.write_text(FRESH_PROCESS_RUNNER)
    repo = Path(__file__).resolve().parents[2]
    args = [sys.executable, str(runner), str(tmp_path / "jobs.pt"), str(tmp_path / "out.pt")]
    result = subprocess.run(args, cwd=repo, capture_output=True, text=True, timeout=900,
                            env={**os.environ, "PYTHONPATH": str(repo), "ATEN_CPU_CAPABILITY": OTHER_KERNELS})
    assert result.returncode == 0, result.stderr[-3000:]
    print(f"this process: {torch.backends.cpu.get_cpu_capability()}; fresh process: {result.stdout.strip()}")
    kinds = set()
    for c, job, loaded in zip(catalogs, jobs, torch.load(tmp_path / "out.pt")):
        program_for = eager_programs(c)
        for entry in (e for e in c.manifest.programs if e.id in job["frames"]):
            kinds.add(entry.descriptor.kind.value)
            with recorded_decisions() as decisions:
                eager = _eager(program_for(entry.id), job["frames"][entry.id], job["state"])
            # Integer outputs (sampled tokens, counts) agree exactly, unless a decision of the eager
            # run was a near-tie. Float values differ in the last bits (other kernels, another CPU,
            # a decomposed op), within the program's reordering bound (tests/helios/numerics.py).
            tolerance = _program_tolerance(entry.descriptor, c.state.layout)
            got = loaded[entry.id]
            if assert_tokens_match(got["outputs"]["tokens"], eager["outputs"]["tokens"], decisions, tolerance,
                                   entry.id):
                continue
            diffs = _compare(entry.id, eager, got, job["state"])
            print(f"{entry.id}: largest difference / scale " + ", ".join(f"{k}={v:.3g}" for k, v in diffs.items())
                  + f" (tolerance {tolerance:.3g})")
            assert max(diffs.values(), default=0.0) <= tolerance, f"{entry.id}: differs from eager: {diffs}"
    assert kinds == {"prefill", "scored_prefill", "decode", "speculative", "mixed"}
    if ci:
        assert sum(len(job["frames"]) for job in jobs) == len(CI_PROGRAMS), "a CI program is missing from the catalogs"


def _program_tolerance(descriptor, layout) -> float:
    """The bundled target's chain at the longest context, plus one draft chain per proposal step."""
    from tiny_catalog import bundled_checkpoints

    context = layout["max_pages_per_slot"] * layout["page_size"]
    target, draft = (c.config for c in bundled_checkpoints())
    return qwen3_tolerance(target, context) + descriptor.proposal_depth * qwen3_tolerance(draft, context)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = max(want.double().abs().max().item(), 1e-30) if want.numel() else 1.0
    return (got.double() - want.double()).abs().max().item() / scale if want.numel() else 0.0


_VALUES_OF = {"top_token_ids": "top_logprobs", "prompt_top_token_ids": "prompt_top_logprobs"}


def _assert_same_ranking(program_id: str, name: str, got: torch.Tensor, want: torch.Tensor, values: torch.Tensor) -> None:
    """Top-k ids equal, except where the eager values of two neighbouring ranks tie within the
    arithmetic's bound (two kernels may order a near-tie either way); the values themselves are
    compared as floats."""
    from tiny_catalog import bundled_checkpoints

    differs = got != want
    if not differs.any():
        return
    margin = 2 * qwen3_tolerance(bundled_checkpoints()[0].config, 4096) * max(float(values.abs().max()), 1e-30)
    gap = (values[..., :-1] - values[..., 1:]).abs()
    near = torch.zeros_like(differs)
    near[..., :-1] |= gap <= margin
    near[..., 1:] |= gap <= margin
    assert bool(near[differs].all()), f"{program_id}: {name} ranks differ from eager beyond near-ties"


def _compare(program_id: str, eager: dict, got: dict, initial: dict) -> dict[str, float]:
    """Largest differences of float outputs and written cache values, relative to the eager values'
    scale; asserts exact agreement of integer outputs and of where the caches were written."""
    diffs = {}
    for name, value in eager["outputs"].items():
        assert got["outputs"][name].dtype == value.dtype, f"{program_id}: {name} dtype"
        if name in ("top_token_ids", "prompt_top_token_ids"):
            _assert_same_ranking(program_id, name, got["outputs"][name], value, eager["outputs"][_VALUES_OF[name]])
            continue
        if not value.is_floating_point():
            assert torch.equal(got["outputs"][name], value), f"{program_id}: {name} differs from eager"
            continue
        diffs[name] = _relative(got["outputs"][name], value)
    for name in ("pending", "seq_lens", "token_counts", "prompt_seen"):
        assert torch.equal(got["writes"][name], eager["state"][name]), f"{program_id}: {name} differs from eager"
    for name in got["cache"]:
        written = eager["state"][name] != initial[name]
        assert written.any() or name.startswith("draft"), f"{program_id}: eager wrote no {name}"
        assert torch.equal(got["cache_where"][name], written.nonzero()), f"{program_id}: {name} written elsewhere"
        if not written.any():  # programs that never run the draft leave its cache alone
            continue
        diffs[name] = _relative(got["cache"][name], eager["state"][name][written])
    return diffs


def test_compile_kinds_choose_which_programs_get_a_package(tmp_path, tokenizer, monkeypatch):
    """Only programs of the compiled kinds are compiled; a catalog where none is says compile: none."""
    from ignition.capture import export

    compiled = []
    monkeypatch.setattr(export.torch._inductor, "aoti_compile_and_package",
                        lambda ep, package_path, inductor_configs: compiled.append(Path(package_path).name)
                        or Path(package_path).write_bytes(b"package"))
    root = write_catalog(stand_in_source(tokenizer), tmp_path / "c", compile="aoti", compile_kinds=("decode",)).path
    manifest = load(root, trust=True).manifest
    assert sorted(compiled) == ["decode_b1.aoti.pt2", "decode_b4.aoti.pt2"] and manifest.compile == "aoti"
    assert {p.id: p.compiled_file for p in manifest.programs} == {
        "prefill_p8": None, "decode_b1": "programs/decode_b1.aoti.pt2", "decode_b4": "programs/decode_b4.aoti.pt2"}
    assert [p.id for p in manifest.programs] == ["prefill_p8", "decode_b1", "decode_b4"]  # plan order kept
    none = write_catalog(stand_in_source(tokenizer), tmp_path / "n", compile="aoti", compile_kinds=("mixed",)).path
    assert load(none).manifest.compile == "none" and len(compiled) == 2


def test_compile_max_width_leaves_wider_programs_exported():
    """compile.max_width 1 packages the width-one programs of the compiled kinds and no wider one."""
    from flare_contract.graphs import GraphDescriptor, GraphKind
    from ignition.capture.build import _compiled_ids

    spec = GraphKind.SPECULATIVE
    graphs = (GraphDescriptor("decode_b1", GraphKind.DECODE, 1),
              GraphDescriptor("spec_b1_d0_w1_p1", spec, 1, proposal_depth=0, width=1, aggregate=1,
                              proposal_source="learned"),
              GraphDescriptor("spec_b1_d1_w2_p2", spec, 1, proposal_depth=1, width=2, aggregate=2,
                              proposal_source="learned"))
    assert _compiled_ids(graphs, "aoti", ("decode", "speculative"), 1) == {"decode_b1", "spec_b1_d0_w1_p1"}
    assert _compiled_ids(graphs, "aoti", ("speculative",), None) == {"spec_b1_d0_w1_p1", "spec_b1_d1_w2_p2"}
    assert _compiled_ids(graphs, "aoti", (), 2) == {g.id for g in graphs}
    assert _compiled_ids(graphs, "none", (), 1) == frozenset()


def test_compile_max_prompt_leaves_larger_prompt_programs_exported():
    """compile.max_prompt 256 packages the prompt programs through 256 tokens; programs with no prompt
    (decode) are compiled whatever the limit."""
    from flare_contract.graphs import GraphDescriptor, GraphKind
    from ignition.capture.build import _compiled_ids

    graphs = tuple(GraphDescriptor(f"prefill_p{p}", GraphKind.PREFILL, 1, prefill_capacity=p) for p in (64, 256, 1024))
    graphs += (GraphDescriptor("decode_b1", GraphKind.DECODE, 1),)
    assert _compiled_ids(graphs, "aoti", ("prefill", "decode"), None, 256) == {"prefill_p64", "prefill_p256",
                                                                               "decode_b1"}
    assert _compiled_ids(graphs, "aoti", ("prefill",), None, 63) == frozenset()
    assert _compiled_ids(graphs, "aoti", (), None, None) == {g.id for g in graphs}


def test_a_recipe_asking_for_aoti_without_a_compiler_exports_only(monkeypatch):
    from ignition.capture import pipeline
    from ignition.recipes import load_recipe

    recipe = load_recipe("flare-tiny")
    monkeypatch.setattr(pipeline, "have_compiler", lambda: False)
    choice = pipeline.compile_choice(pipeline.CaptureRequest("flare-tiny", Path("x")), recipe)
    assert (choice.mode, choice.kinds) == ("none", ()) and "no C++ compiler" in choice.note
    with pytest.raises(CaptureError, match=r"needs a C\+\+ compiler"):
        pipeline.compile_choice(pipeline.CaptureRequest("flare-tiny", Path("x"), compile="aoti"), recipe)
    monkeypatch.setattr(pipeline, "have_compiler", lambda: True)
    choice = pipeline.compile_choice(pipeline.CaptureRequest("flare-tiny", Path("x"), compile_kinds=()), recipe)
    assert (choice.mode, choice.kinds, choice.note) == ("aoti", (), None)  # --compile-kinds all
    assert pipeline.compile_choice(pipeline.CaptureRequest("flare-tiny", Path("x"), compile="none"), recipe).mode == "none"


@pytest.mark.slow
@pytest.mark.numerics
def test_C1_compiled_programs_equal_eager_greedy_and_seeded_and_repeat_exactly(catalog, tmp_path):
    """A prompt chunk, a decode batch and two speculative rounds of the bundled model, compiled with
    capture's AOTInductor settings:
    greedy rows and seeded sampling rows (the frame has both) give eager's tokens unless a decision was a
    near-tie, floats and cache writes stay within the arithmetic's bound, and a second run on the same
    inputs repeats every token and value bitwise (seeded sampling is reproducible)."""
    from helios.catalog.load import CatalogProgram
    from ignition.capture.export import AOTI_CONFIGS
    from tiny_catalog import eager_programs

    gen = torch.Generator().manual_seed(3)
    # a draft-keeping width-one round and a learned width-two round absorb into the draft's cache after
    # committing: the slot-state write must not be read back there (it once was, compiled: the draft's K/V
    # landed one position late)
    job = _job(catalog, gen, ("prefill_p64", "decode_b4", "spec_b2_d0_w1_p2", "spec_b2_d1_w2_p4"))
    program_for = eager_programs(catalog)
    state_names = frozenset(t.name for t in catalog.state.tensors)
    for program_id, frame in job["frames"].items():
        entry = catalog.entry(program_id)
        package = tmp_path / f"{program_id}.aoti.pt2"
        exported = torch.export.load(catalog.path / entry.file)  # saved without example inputs; compile needs them
        binder = CatalogProgram(entry, None, catalog.program_weights, state_names)
        exported.example_inputs = (binder.bind({**frame, **job["state"]}), {})
        torch._inductor.aoti_compile_and_package(exported, package_path=str(package), inductor_configs=AOTI_CONFIGS)
        compiled = CatalogProgram(entry, torch._inductor.aoti_load_package(str(package)), catalog.program_weights,
                                  state_names)
        runs = []
        for _ in range(2):
            state = {name: t.clone() for name, t in job["state"].items()}
            runs.append({"outputs": compiled(**frame, **state), "state": state})
        for name, value in runs[0]["outputs"].items():
            assert torch.equal(runs[1]["outputs"][name], value), f"{program_id}: {name} not reproducible"
        assert all(torch.equal(runs[1]["state"][n], t) for n, t in runs[0]["state"].items())
        with recorded_decisions() as decisions:
            eager = _eager(program_for(program_id), frame, job["state"])
        tolerance = _program_tolerance(entry.descriptor, catalog.state.layout)
        got = runs[0]
        caches = [n for n in ("k_cache", "v_cache", "draft_k_cache", "draft_v_cache") if n in job["state"]]
        cache = {n: got["state"][n][job["state"][n] != got["state"][n]] for n in caches}
        got = {**got, "writes": {n: got["state"][n] for n in ("pending", "seq_lens", "token_counts", "prompt_seen")},
               "cache": cache,
               "cache_where": {n: (job["state"][n] != runs[0]["state"][n]).nonzero() for n in cache}}
        if assert_tokens_match(got["outputs"]["tokens"], eager["outputs"]["tokens"], decisions, tolerance, program_id):
            continue
        diffs = _compare(program_id, eager, got, job["state"])
        assert max(diffs.values(), default=0.0) <= tolerance, f"{program_id}: compiled differs from eager: {diffs}"
