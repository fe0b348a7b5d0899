"""Calling an AOTInductor package without the GIL.

torch's Python binding of the package loader's ``boxed_run`` lets the GIL go,
but the package frees each input after its last use, and freeing the last C++
reference to a Python-owned tensor takes the GIL back (about 40 times per
decode step). The device worker calls programs back to back, so each of those
points waited while the control thread (planning the next frame) or the event
loop (writing tokens) ran Python. ``csrc/released_call.cpp`` passes the
package the same tensors under C++ objects Python does not own and runs
``boxed_run`` with the GIL released: the native code it runs (the package and
the ``flare::`` kernels) then takes no Python at all (docs/runtime.md,
"Programs and kernels"; figures in docs/benchmarks.md, "Compiled programs
without the GIL, prompts in order").

The library is compiled once per machine, like the ops' kernels
(``helios.ops.kernels``), and linked against torch's Python bindings.
``FLARE_COMPILED_CALL`` chooses: ``released`` (the default; when the library
cannot be built or the loader not read, programs are called as torch does,
with one warning) or ``held`` (torch's own call).
"""

from __future__ import annotations

import ctypes
import os
import sysconfig
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from flare_contract.cli import BadInput
from helios.ops import kernels

ENV = "FLARE_COMPILED_CALL"
CHOICES = ("released", "held")
SOURCE = Path(__file__).with_name("csrc") / "released_call.cpp"
LIBRARY_NAME = "libflare_released_call.so"


class CompiledCallChoiceError(BadInput):
    """``FLARE_COMPILED_CALL`` names no choice: bad input, one line and exit 2."""


class _State:
    library: ctypes.PyDLL | None = None
    failed: str | None = None  # why the library is unusable in this process, once known


def choice() -> str:
    value = (os.environ.get(ENV) or "released").strip().lower()
    if value not in CHOICES:
        raise CompiledCallChoiceError(f"{ENV}={value!r} is not one of {', '.join(CHOICES)}")
    return value


def prepare() -> str:
    """Check ``FLARE_COMPILED_CALL`` and build or load the library now (``flare run`` does this before
    its warm-up); says in one line how compiled programs will be called."""
    if choice() == "held":
        return f"compiled programs hold the GIL while they run ({ENV}=held)"
    if _library() is None:
        return f"compiled programs hold the GIL while they run: {_State.failed}"
    return "compiled programs release the GIL while they run"


def released_run(loader: Any) -> Callable[[list], tuple] | None:
    """A call of ``loader.boxed_run`` (a flat list of tensors in, a tuple out) that holds no GIL while
    the program runs; None where ``FLARE_COMPILED_CALL=held``, the library is unusable or
    ``loader`` is not torch's package loader."""
    if choice() == "held" or not isinstance(loader, torch._C._aoti.AOTIModelPackageLoader):
        return None
    library = _library()
    if library is None:
        return None
    try:
        pointer = library.flare_loader_pointer(loader)
    except (TypeError, ValueError) as exc:  # a loader this build cannot read: torch's own call serves
        _give_up(f"cannot read the package loader ({exc})")
        return None
    run = library.flare_boxed_run

    def call(flat: list, _owner: Any = loader) -> tuple:  # the pointer is valid while the loader lives
        return run(pointer, flat)

    return call


def _library() -> ctypes.PyDLL | None:
    if _State.library is None and _State.failed is None:
        try:
            path = kernels.built_library(SOURCE, LIBRARY_NAME, compile_command())
            library = ctypes.PyDLL(str(path))  # the calls start and end with the GIL (the C++ releases it)
        except (kernels.NativeKernelsUnavailable, OSError) as exc:
            _give_up(str(exc))
            return None
        library.flare_loader_pointer.argtypes = [ctypes.py_object]
        library.flare_loader_pointer.restype = ctypes.c_void_p
        library.flare_boxed_run.argtypes = [ctypes.c_void_p, ctypes.py_object]
        library.flare_boxed_run.restype = ctypes.py_object
        _State.library = library
    return _State.library


def _give_up(reason: str) -> None:
    _State.failed = reason
    warnings.warn(f"compiled programs hold the GIL while they run: {reason}", RuntimeWarning, stacklevel=3)


def compile_command() -> list[str]:
    torch_include = Path(torch.__file__).parent / "include"
    includes = (torch_include / "torch" / "csrc" / "api" / "include", Path(sysconfig.get_paths()["include"]))
    return kernels.compile_command(SOURCE, ["-O2"], ["-ltorch_python", "-ltorch_cpu", "-lc10"], includes)
