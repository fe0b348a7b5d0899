"""Which CPU kernels serve the ``flare::`` ops: native C++ (built once per machine) or the Python references.

The Python kernels are plain torch code that runs on any installation, at a
few dozen aten calls per row through Python. The native kernels
(``csrc/flare_ops.cpp``) do the same work in one C++ call per op, and never
take the GIL, so an AOTInductor-compiled program that calls them runs with
no Python at all. They are compiled here with the machine's C++ compiler the
first time a process needs them, into
``$XDG_CACHE_HOME/flare/ops/<digest>/`` (the digest covers the source, torch's
release, the compiler command and the CPU), and loaded from there afterwards.

``FLARE_OPS_KERNELS`` chooses: ``auto`` (the default: native when a compiler
builds them, else Python with one warning), ``native`` (fail when they cannot
be built) or ``python``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from flare_contract.cli import BadInput
from helios.ops import attention, kv_cache, linear, sampling, slot_state

ENV = "FLARE_OPS_KERNELS"
CHOICES = ("auto", "native", "python")
SOURCE = Path(__file__).with_name("csrc") / "flare_ops.cpp"
LIBRARY_NAME = "libflare_ops.so"
PACK_ENV = "FLARE_LINEAR_PACK"  # 1 (the default): pack the catalog's linear weights where the build can

_PYTHON_KERNELS = {
    "write_kv": kv_cache.write_kv,
    "paged_attention": attention.paged_attention,
    "write_slot_state": slot_state.write_slot_state,
    "write_token_history": slot_state.write_token_history,
    "linear": linear.linear,
    "sample": sampling.sample,
}
# ops with no native kernel yet: the Python one serves under either choice
_PYTHON_ONLY: dict = {}


class NativeKernelsUnavailable(RuntimeError):
    """The native kernels could not be built or loaded; the message says why in one line."""


class KernelChoiceError(NativeKernelsUnavailable, BadInput):
    """``FLARE_OPS_KERNELS`` names no kernel choice: bad input, one line and exit 2 from either CLI."""


class _Installed:
    kind: str | None = None  # "native" or "python" once chosen
    python_library: torch.library.Library | None = None
    native: ctypes.CDLL | None = None  # the loaded native library, for its settings (native_linear_rows)


def active() -> str:
    """``native`` or ``python``: the kernels this process installed (chosen on first import of helios.ops)."""
    if _Installed.kind is None:
        install()
    return _Installed.kind  # type: ignore[return-value]


def install(choice: str | None = None) -> str:
    """Install the CPU kernels once per process, as ``FLARE_OPS_KERNELS`` (or ``choice``) says."""
    if _Installed.kind is not None:
        return _Installed.kind
    choice = (choice or os.environ.get(ENV) or "auto").strip().lower()
    if choice not in CHOICES:
        raise KernelChoiceError(f"{ENV}={choice!r} is not one of {', '.join(CHOICES)}")
    if choice != "python":
        try:
            library = native_library()
            _load(library)
            _Installed.native = ctypes.CDLL(str(library))  # the image torch loaded: the same globals
            _Installed.native.flare_linear_native_rows.argtypes = [ctypes.c_int64]
            _Installed.native.flare_linear_native_rows.restype = ctypes.c_int64
            _Installed.native.flare_linear_chunk_rows.argtypes = [ctypes.c_int64]
            _Installed.native.flare_linear_chunk_rows.restype = ctypes.c_int64
            _Installed.native.flare_linear_packs.argtypes = []
            _Installed.native.flare_linear_ahead_from.argtypes = [ctypes.c_int64]
            _Installed.native.flare_linear_ahead_from.restype = ctypes.c_int64
            _Installed.native.flare_linear_packs.restype = ctypes.c_int64
            _install_python(_PYTHON_ONLY)
            _Installed.kind = "native"
            return "native"
        except NativeKernelsUnavailable as exc:
            if choice == "native":
                raise
            warnings.warn(f"flare ops: using the Python kernels ({exc})", RuntimeWarning, stacklevel=2)
    _install_python({**_PYTHON_KERNELS, **_PYTHON_ONLY})
    _Installed.kind = "python"
    return "python"


def native_linear_rows(rows: int | None = None) -> int | None:
    """The largest row count ``flare::linear``'s native kernel serves in this process (ATen's GEMM above it),
    after setting it to ``rows`` (clamped to 16..256) when given; None with the Python kernels (ATen always).
    ``helios.ops.linear.choose_native_rows`` sets it from a measurement (csrc/flare_ops.cpp)."""
    if active() != "native":
        return None
    setting = _Installed.native.flare_linear_native_rows  # type: ignore[union-attr]
    if rows is not None:
        setting(int(rows))
    return int(setting(-1))


def native_linear_chunk_rows(rows: int | None = None) -> int | None:
    """The largest row count ``flare::linear``'s native kernel runs in its chunked loop order in this
    process (the panel order above it), after setting it to ``rows`` (clamped to 0..64) when given; 0 where
    the library was built without AVX-512, None with the Python kernels.
    ``helios.ops.linear.choose_chunk_rows`` sets it from a measurement (csrc/flare_ops.cpp)."""
    if active() != "native":
        return None
    setting = _Installed.native.flare_linear_chunk_rows  # type: ignore[union-attr]
    if rows is not None:
        setting(int(rows))
    return int(setting(-1))


def packs_linear_weights() -> bool:
    """Whether this process lays ``flare::linear``'s weights out for its packed kernel at catalog load: the
    native kernels, built with AVX-512 (csrc/flare_ops.cpp, "Packed weights"), and ``FLARE_LINEAR_PACK``
    not 0. A bad ``FLARE_LINEAR_PACK`` is bad input (one line, exit 2)."""
    raw = os.environ.get(PACK_ENV, "1").strip()
    if raw not in ("0", "1"):
        raise KernelChoiceError(f"{PACK_ENV}={raw!r} is not 0 or 1")
    if raw == "0" or active() != "native":
        return False
    return bool(_Installed.native.flare_linear_packs())  # type: ignore[union-attr]


def native_linear_ahead_from(rows: int | None = None) -> int | None:
    """The fewest rows at which ``flare::linear``'s packed products ask for the next chunk of weights ahead
    of use in this process (``NEVER_AHEAD``: never), after setting it to ``rows`` when given; None with the
    Python kernels. ``helios.ops.linear.choose_ahead_from`` sets it from a measurement (csrc/flare_ops.cpp,
    "Packed weights")."""
    if active() != "native":
        return None
    setting = _Installed.native.flare_linear_ahead_from  # type: ignore[union-attr]
    if rows is not None:
        setting(int(rows))
    return int(setting(-1))


NEVER_AHEAD = 1 << 20  # csrc/flare_ops.cpp: kMaxAheadFrom


def native_linear_row_rows(rows: int | None = None) -> int | None:
    """The largest row count ``flare::linear``'s native kernel runs in its row order in this process (one
    weight row at a time, read as one sequential stream), after setting it to ``rows`` (clamped to 0..64)
    when given; None with the Python kernels. ``helios.ops.linear.choose_row_rows`` sets it from a
    measurement (csrc/flare_ops.cpp)."""
    if active() != "native":
        return None
    setting = _Installed.native.flare_linear_row_rows  # type: ignore[union-attr]
    if rows is not None:
        setting(int(rows))
    return int(setting(-1))


def _load(library: Path) -> None:
    try:
        torch.ops.load_library(str(library))
    except OSError as exc:
        raise NativeKernelsUnavailable(f"cannot load {library}: {exc}") from None


def _install_python(kernels: dict) -> None:
    library = torch.library.Library("flare", "IMPL")
    for name, kernel in kernels.items():
        library.impl(name, kernel, "CPU")
    _Installed.python_library = library


def native_library(cache: Path | None = None) -> Path:
    """The built native library for this machine, compiling it first if the cache lacks it."""
    return built_library(SOURCE, LIBRARY_NAME, _compile_command(), cache)


def built_library(source: Path, name: str, command: list[str], cache: Path | None = None) -> Path:
    """``source`` compiled by ``command`` (without its ``-o``) into the cache folder of their digest.

    Also serves helios/catalog/released.py, whose library links torch's Python bindings.
    """
    folder = (cache or _cache_root()) / _digest(command, source)
    library = folder / name
    if library.is_file():
        return library
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _build(command, folder, library, source)
    except OSError as exc:  # a read-only or full cache folder
        raise NativeKernelsUnavailable(f"cannot build into {folder}: {exc}") from None
    return library


def _build(command: list[str], folder: Path, library: Path, source: Path) -> None:
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        partial = Path(scratch) / library.name
        try:
            done = subprocess.run([*command, "-o", str(partial)], capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            raise NativeKernelsUnavailable("the C++ compiler ran for more than 600 s") from None
        if done.returncode != 0:
            (folder / "build.log").write_text(done.stdout + done.stderr)
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise NativeKernelsUnavailable(f"compiling {source.name} failed ({last[:200]}); log: {folder / 'build.log'}")
        os.replace(partial, library)  # atomic: a concurrent build of the same digest just replaces it


def _compiler() -> str:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        raise NativeKernelsUnavailable("no C++ compiler (set CXX, or install c++/g++)")
    return compiler


def _compile_command() -> list[str]:
    return compile_command(SOURCE, ["-O3", "-march=native"], ["-ltorch_cpu", "-lc10"])


def compile_command(source: Path, options: list[str], libraries: list[str], includes: tuple[Path, ...] = ()) -> list[str]:
    """A shared library's compile command against this torch (``-o`` left to ``built_library``)."""
    torch_dir = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        _compiler(), str(source), *options, "-std=c++20", "-shared", "-fPIC", "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{torch_dir / 'include'}", *(f"-I{p}" for p in includes),
        f"-L{torch_dir / 'lib'}", *libraries, f"-Wl,-rpath,{torch_dir / 'lib'}",
    ]


def _digest(command: list[str], source: Path = SOURCE) -> str:
    h = hashlib.sha256()
    for part in (source.read_bytes(), torch.__version__.encode(), " ".join(command).encode(),
                 platform.machine().encode(), _cpu_flags().encode(), sys.platform.encode()):
        h.update(part + b"\0")
    return h.hexdigest()[:16]


def _cpu_flags() -> str:
    """The CPU's feature flags (``-march=native`` code is built for them)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "flare" / "ops"
