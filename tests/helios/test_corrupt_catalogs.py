"""Corrupted catalogs: one specific line and exit 2, never a traceback or a silent load (issue 17, part 7).

Each case damages a copy of the session's tiny catalog the way a bad disk, a
careless edit or an attacker would, then runs `ignition inspect`,
`ignition inspect --json` and `flare run`'s load path in-process. The flare
run path stops before any engine is built: reaching it means the catalog
loaded, which is the failure these tests exist to catch.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from helios import launch
from helios.catalog.load import RECIPE_KEYS
from helios.cli import app as flare_app
from ignition.cli import app as ignition_app

runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pristine(catalog, tmp_path_factory) -> Path:
    """One private copy of the tiny catalog; every case hard-links its files and never writes through them."""
    return Path(shutil.copytree(catalog.path, tmp_path_factory.mktemp("corrupt") / "pristine"))


def damaged_copy(pristine: Path, folder: Path) -> Path:
    """Hard links of every file but the manifest, which is copied (cases rewrite it)."""
    for source in pristine.rglob("*"):
        target = folder / source.relative_to(pristine)
        if source.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif source.name == "catalog.yaml":
            shutil.copyfile(source, target)
        else:
            os.link(source, target)
    return folder


# -- how the cases damage a catalog -----------------------------------------------------------------


def manifest(change: Callable[[dict], object]) -> Callable[[Path], None]:
    def apply(root: Path) -> None:
        raw = yaml.load((root / "catalog.yaml").read_text(), Loader=yaml.CSafeLoader)
        change(raw)
        (root / "catalog.yaml").write_text(yaml.dump(raw, Dumper=yaml.CSafeDumper, sort_keys=False))
    return apply


def text(change: Callable[[str], str]) -> Callable[[Path], None]:
    def apply(root: Path) -> None:
        path = root / "catalog.yaml"
        path.write_text(change(path.read_text()))
    return apply


def replace_file(root: Path, relative: str, data: bytes) -> None:
    """A new file in place of a hard link (writing through it would damage the pristine copy)."""
    (root / relative).unlink()
    (root / relative).write_bytes(data)


def rehash(root: Path, relative: str) -> None:
    """What an attacker does after changing a file: make the manifest's hash agree."""
    from flare_contract.manifest import file_sha256

    digest = file_sha256(root / relative)
    raw = yaml.load((root / "catalog.yaml").read_text(), Loader=yaml.CSafeLoader)
    for entry in raw["weights"] + raw["programs"]:
        if entry["file"] == relative:
            entry["sha256"] = digest
    (root / "catalog.yaml").write_text(yaml.dump(raw, Dumper=yaml.CSafeDumper, sort_keys=False))


def program(raw: dict, program_id: str) -> dict:
    return next(p for p in raw["programs"] if p["id"] == program_id)


def state_tensor(raw: dict, name: str) -> dict:
    return next(t for t in raw["state"]["tensors"] if t["name"] == name)


def truncated_weights(root: Path) -> None:
    weights = root / "weights" / "draft.safetensors"
    replace_file(root, "weights/draft.safetensors", weights.read_bytes()[:-4096])
    rehash(root, "weights/draft.safetensors")


def weights_outside(root: Path) -> None:
    outside = root.parent / "elsewhere.safetensors"  # the same bytes, so even the hash agrees
    shutil.copyfile(root / "weights" / "draft.safetensors", outside)
    (root / "weights" / "draft.safetensors").unlink()
    (root / "weights" / "draft.safetensors").symlink_to(outside)


def symlink_loop(root: Path) -> None:
    (root / "programs" / "decode_b1.pt2").unlink()
    (root / "programs" / "decode_b1.pt2").symlink_to("decode_b1.pt2")


def modified_program(root: Path) -> None:
    replace_file(root, "programs/decode_b2.pt2", (root / "programs" / "decode_b2.pt2").read_bytes() + b"\0")


BOMB = "".join(f"x{i}: &x{i} [" + ", ".join([f"*x{i - 1}"] * 9 if i else ["lol"] * 9) + "]\n" for i in range(9))

CASES: list[tuple[str, Callable[[Path], None], str]] = [
    ("no manifest", lambda root: (root / "catalog.yaml").unlink(), "not a catalog (no catalog.yaml)"),
    ("manifest not YAML", text(lambda t: "format_version: 4\nprograms: [\n"), "not valid YAML"),
    ("manifest a list", text(lambda t: "- 1\n- 2\n"), "no format_version"),
    ("alias bomb in the manifest", text(lambda t: BOMB + t), "a YAML alias at line 2 (manifests have none)"),
    ("nesting 100 deep", text(lambda t: t + "junk: " + "[" * 100 + "]" * 100 + "\n"), "nested more than 32 deep"),
    ("format_version a string", text(lambda t: t.replace("format_version: 4", "format_version: '4'", 1)),
     "format_version must be the integer 4, got '4' (str)"),
    ("format_version 2", manifest(lambda r: r.update(format_version=2)), "format version 2 but this Flare reads version 4"),
    ("format_version 3: no state programs", manifest(lambda r: r.update(format_version=3)),
     "format version 3 but this Flare reads version 4 (program contract 4: snapshot, restore and init programs"),
    ("flare_version from the future", manifest(lambda r: r.update(flare_version="99.0.0")),
     "captured by Flare 99.0.0, newer than this Flare"),
    ("flare_version not a version", manifest(lambda r: r.update(flare_version="banana")), "'banana' is not a version"),
    ("another torch release", manifest(lambda r: r.update(torch_version="2.9.1+cpu")), "captured with torch 2.9.1+cpu"),
    ("junk key in the recipe", manifest(lambda r: r["recipe"].update(junk=1)), "recipe: unknown key 'junk'"),
    ("junk key in recipe.capacity", manifest(lambda r: r["recipe"]["capacity"].update(turbo=True)),
     "recipe.capacity: unknown key 'turbo'"),
    ("tokenizer section a list", manifest(lambda r: r.update(tokenizer=["tokenizer.json"])), "tokenizer: expected a mapping"),
    ("device of an unknown kind", manifest(lambda r: r["device"].update(kind="tpu")), "device.kind 'tpu' is not one of"),
    ("envelope lacks request_slots", manifest(lambda r: r["envelope"].pop("request_slots")), "envelope lacks request_slots"),
    ("envelope slots disagree with the layout", manifest(lambda r: r["envelope"].update(request_slots=8)),
     "state.layout.request_slots 4 differs from envelope.request_slots 8"),
    ("layout lacks num_pages", manifest(lambda r: r["state"]["layout"].pop("num_pages")), "state.layout lacks num_pages"),
    ("layout key misspelt", manifest(lambda r: r["state"]["layout"].update(num_page=r["state"]["layout"].pop("num_pages"))),
     "lacks num_pages (a paged cache needs request_slots, page_size, num_pages, max_pages_per_slot; it has"),
    ("layout value a word", manifest(lambda r: r["state"]["layout"].update(page_size="sixteen")),
     "state.layout.page_size must be an integer >= 1, got 'sixteen'"),
    ("absurd page count", manifest(lambda r: r["state"]["layout"].update(num_pages=10**12)),
     "the layout's 1000000000000 pages of 16"),
    ("absurd state shape", manifest(lambda r: state_tensor(r, "v_cache").update(shape=[4, 1024, 16, 2, 64, 10**9])),
     "state tensor v_cache has shape [4, 1024, 16, 2, 64, 1000000000]"),
    ("negative state dimension", manifest(lambda r: state_tensor(r, "pending").update(shape=[-4])),
     "state tensor pending: shape [-4] needs integers >= 1"),
    ("checkpoint store without rows", manifest(lambda r: r["state"]["layout"].update(checkpoint_rows=0)),
     "state has checkpoint tensors but no paged cache with state.layout.checkpoint_rows >= 1"),
    ("checkpoint rows of too few pages", manifest(lambda r: state_tensor(r, "checkpoint_k").update(shape=[4, 256, 16, 2, 64])),
     "state tensor checkpoint_k is [4, 256, 16, 2, 64] float32, but 2 checkpoint rows beside k_cache need [4, 512, 16, 2, 64]"),
    ("checkpoint store without the draft's KV", manifest(lambda r: r["state"].update(
        tensors=[t for t in r["state"]["tensors"] if t["name"] != "checkpoint_draft_v"])),
     "state has one of draft_v_cache and checkpoint_draft_v without the other"),
    ("unknown state dtype", manifest(lambda r: state_tensor(r, "seq_lens").update(dtype="float99")),
     "state tensor seq_lens: dtype 'float99' is not one of"),
    ("program input disagrees with the state", manifest(
        lambda r: next(a for a in program(r, "decode_b2")["inputs"] if a["name"] == "k_cache").update(dtype="float16")),
     "program decode_b2 input k_cache is [4, 1024, 16, 2, 64] float16, but the state records"),
    ("program of an unknown kind", manifest(lambda r: program(r, "decode_b1").update(kind="warp")), "'warp' is not a valid GraphKind"),
    ("batch capacity a string", manifest(lambda r: program(r, "decode_b4").update(batch_capacity="4")),
     "malformed manifest (TypeError"),
    ("width a float", manifest(lambda r: program(r, "decode_b4").update(width=1.0)),
     "program decode_b4 width must be an integer >= 0, got 1.0"),
    ("program listed twice", manifest(lambda r: r["programs"].append(copy.deepcopy(r["programs"][0]))),
     "program id 'prefill_p64' is listed twice"),
    ("unknown weight set", manifest(lambda r: program(r, "decode_b1")["inputs"][0].update(weights="nope")),
     "takes weight set 'nope', but the catalog has only ['draft', 'target']"),
    ("program at an absolute path", manifest(lambda r: program(r, "decode_b1").update(file="/etc/passwd")),
     "file '/etc/passwd' must be a plain relative path inside the catalog"),
    ("program path climbing out", manifest(lambda r: program(r, "decode_b1").update(file="programs/../../x.pt2")),
     "file 'programs/../../x.pt2' must be a plain relative path inside the catalog"),
    ("tokenizer file climbing out", manifest(
        lambda r: r["tokenizer"]["files"].update({"../../etc/passwd": "0" * 64})),
     "tokenizer file '../../etc/passwd' is not a plain file name"),
    ("tokenizer.json not listed", manifest(lambda r: r["tokenizer"]["files"].pop("tokenizer.json")),
     "tokenizer.files does not list tokenizer.json"),
    ("weights symlinked outside", weights_outside, "draft.safetensors: leads outside the catalog"),
    ("symlink loop", symlink_loop, "decode_b1.pt2: a symlink loop"),
    ("program missing", lambda root: (root / "programs" / "decode_b4.pt2").unlink(), "decode_b4.pt2: missing from the catalog"),
    ("program modified", modified_program, "decode_b2.pt2: sha256"),
    ("weights truncated, hash rewritten", truncated_weights, "draft.safetensors: 6294736 bytes, but its header describes"),
    ("weights lack a recorded tensor", manifest(lambda r: r["weights"][0]["keys"].append("model.bogus.weight")),
     "lacks weights ['model.bogus.weight'] recorded in the manifest"),
    ("a linear key the set lacks",
     manifest(lambda r: r["weights"][0].setdefault("linear_keys", []).append("model.bogus.weight")),
     "weight set 'target': linear_keys ['model.bogus.weight'] are not among its keys"),
]


@pytest.fixture(params=CASES, ids=[case[0] for case in CASES])
def damaged(request, pristine, tmp_path) -> tuple[Path, str]:
    _, damage, complaint = request.param
    root = damaged_copy(pristine, tmp_path / "catalog")
    damage(root)
    return root, complaint


class _NoEngine:
    def __init__(self, catalog, *args, **kwargs):
        raise AssertionError(f"{catalog.path} loaded: flare run reached the engine")


def one_error_line(result, complaint: str) -> None:
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-2000:]
    assert complaint in lines[0], lines[0]
    assert len(lines[0]) < 600, lines[0]


def test_a_damaged_catalog_is_one_specific_line_and_exit_2_everywhere(damaged, monkeypatch):
    root, complaint = damaged
    one_error_line(runner.invoke(ignition_app, ["inspect", str(root)]), complaint)
    as_json = runner.invoke(ignition_app, ["inspect", str(root), "--json"])
    one_error_line(as_json, complaint)
    assert as_json.stdout == ""
    monkeypatch.setattr(launch, "HeliosEngine", _NoEngine)
    one_error_line(runner.invoke(flare_app, ["run", str(root), "--port", "0"]), complaint)


def test_there_are_at_least_25_cases():
    assert len(CASES) >= 25 and len({case[0] for case in CASES}) == len(CASES)


def test_the_pristine_copy_loads_through_every_path(pristine, monkeypatch):
    """The cases fail because of their damage, not because a copy cannot load."""
    assert runner.invoke(ignition_app, ["inspect", str(pristine), "--json"]).exit_code == 0
    monkeypatch.setattr(launch, "HeliosEngine", _NoEngine)
    result = runner.invoke(flare_app, ["run", str(pristine), "--port", "0"])
    assert isinstance(result.exception, AssertionError) and "reached the engine" in str(result.exception)


# -- what only the server's load path judges ------------------------------------------------------


def test_flare_run_refuses_a_state_larger_than_this_machine_before_allocating_it(pristine, tmp_path, monkeypatch):
    """A consistent but enormous page count would only fail (or swap the machine to death) at allocation."""
    root = damaged_copy(pristine, tmp_path / "catalog")

    def enormous(raw: dict) -> None:
        pages = 10**9
        raw["state"]["layout"]["num_pages"] = pages
        for tensor in [*raw["state"]["tensors"], *(a for p in raw["programs"] for a in p["inputs"])]:
            if tensor["name"].endswith("_cache"):
                tensor["shape"][1] = pages

    manifest(enormous)(root)
    assert runner.invoke(ignition_app, ["inspect", str(root)]).exit_code == 0, "a big catalog is still a valid one"
    monkeypatch.setattr(launch, "HeliosEngine", _NoEngine)
    one_error_line(runner.invoke(flare_app, ["run", str(root), "--port", "0"]), "GiB, more than this machine's")


def test_flare_run_refuses_a_tokenizer_it_cannot_read(pristine, tmp_path, monkeypatch):
    root = damaged_copy(pristine, tmp_path / "catalog")
    replace_file(root, "tokenizer/tokenizer.json", b'{"not": "a tokenizer"}')
    from flare_contract.manifest import file_sha256

    manifest(lambda r: r["tokenizer"]["files"].update({"tokenizer.json": file_sha256(root / "tokenizer/tokenizer.json")}))(root)
    monkeypatch.setattr(launch, "HeliosEngine", _NoEngine)
    one_error_line(runner.invoke(flare_app, ["run", str(root), "--port", "0"]), "tokenizer.json: not a tokenizer")


def test_a_real_flare_run_process_exits_2_with_one_line(pristine, tmp_path):
    """The exit status from a real process, once (the cases above run in-process)."""
    root = damaged_copy(pristine, tmp_path / "catalog")
    manifest(lambda r: r["recipe"].update(junk=1))(root)
    result = subprocess.run([sys.executable, "-m", "helios.cli", "run", str(root), "--port", "0"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    errors = [line for line in result.stderr.splitlines() if "flare.run" not in line]
    assert result.returncode == 2, result.stderr[-2000:]
    assert errors == [errors[0]] and errors[0].startswith("error: ") and "unknown key 'junk'" in errors[0], result.stderr


def test_the_recipe_keys_helios_accepts_are_the_recipe_schema(catalog):
    """helios lists the recipe section's keys (it never imports ignition); they must stay ignition's fields."""
    import dataclasses

    from ignition.recipes.schema import CapacityDefaults, CheckpointDefaults, CompileDefaults, ModelDims, ModelSource, Recipe

    assert set(RECIPE_KEYS) == {f.name for f in dataclasses.fields(Recipe)}
    assert set(RECIPE_KEYS["capacity"]) == {f.name for f in dataclasses.fields(CapacityDefaults)}
    assert set(RECIPE_KEYS["compile"]) == {f.name for f in dataclasses.fields(CompileDefaults)}
    assert set(RECIPE_KEYS["checkpoints"]) == {f.name for f in dataclasses.fields(CheckpointDefaults)}
    for source in ("target", "draft"):
        assert set(RECIPE_KEYS[source]) == {f.name for f in dataclasses.fields(ModelSource)}
        assert set(RECIPE_KEYS[source]["dimensions"]) == {f.name for f in dataclasses.fields(ModelDims)}
    assert set(catalog.manifest.recipe) <= set(RECIPE_KEYS)


# -- startup order (issue 17, part 8) -------------------------------------------------------------


def test_a_busy_port_is_one_line_and_exit_2_before_the_catalog_is_even_read(pristine, monkeypatch, caplog):
    import socket

    monkeypatch.setattr(launch, "HeliosEngine", _NoEngine)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with caplog.at_level("INFO", logger="flare.run"):
            result = runner.invoke(flare_app, ["run", str(pristine), "--port", str(port)])
    one_error_line(result, f"--port {port}: cannot listen there (Address already in use)")
    assert not [r for r in caplog.records if "load catalog" in r.getMessage()], "it read the catalog first"
