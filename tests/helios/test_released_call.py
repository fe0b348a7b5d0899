"""Compiled programs called without the GIL (helios.catalog.released, csrc/released_call.cpp).

The released call gives the package's own outputs, and the program runs to its end while another
thread holds the GIL (torch's binding takes it back whenever the package frees a Python-owned input).
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time

import pytest
import torch

from helios.catalog import released


class _Chain(torch.nn.Module):
    """Enough matrix products for one call to last milliseconds of native code; then it sets ``flag``."""

    def forward(self, x: torch.Tensor, w: torch.Tensor, flag: torch.Tensor):
        for _ in range(48):
            x = torch.tanh(x @ w)
        flag.fill_(1.0)  # a mutated input, as the catalog's state is
        return x, x.sum()


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    if released._library() is None:  # no C++ compiler or no Python headers: torch's own call serves
        pytest.skip(f"the released call cannot be built here: {released._State.failed}")
    exported = torch.export.export(_Chain(), (torch.randn(64, 512), torch.randn(512, 512), torch.zeros(1)))
    path = tmp_path_factory.mktemp("released") / "chain.pt2"
    torch._inductor.aoti_compile_and_package(exported, package_path=str(path))
    return torch._inductor.aoti_load_package(str(path))


def _inputs():
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(64, 512, generator=generator), torch.randn(512, 512, generator=generator) / 32,
            torch.zeros(1)]


def _released(package):
    run = released.released_run(package.loader)
    if run is None:
        pytest.fail(f"no released call: {released._State.failed}")
    return run


def test_the_released_call_gives_the_packages_own_outputs(package):
    own_inputs, inputs = _inputs(), _inputs()
    own = package.loader.boxed_run(own_inputs)
    got = _released(package)(inputs)
    assert isinstance(got, tuple) and len(got) == len(own) == 2
    for a, b in zip(got, own):
        assert torch.equal(a, b)
    assert inputs[2].item() == 1.0, "the program's write to its mutated input was lost"
    assert torch.equal(inputs[0], _inputs()[0]), "the call changed an input it does not mutate"


def test_the_program_runs_to_its_end_while_another_thread_holds_the_gil(package):
    """Another thread takes the GIL as the call starts and keeps it (the switch interval is made longer
    than the test), reading the program's flag straight from memory: it must see the flag unset at
    first and then set, so the program ran, and finished, with no GIL at all. A call that kept the GIL
    would let the reader start only after it (flag already set); one that took it back for any tensor
    reference inside would wait for the reader (flag never set while it reads)."""
    run = _released(package)
    inputs = _inputs()
    cell = ctypes.c_float.from_address(inputs[2].data_ptr())
    go, seen = threading.Event(), []

    def read():
        go.wait()
        seen.append(cell.value)
        deadline = time.perf_counter() + 5.0
        while time.perf_counter() < deadline and cell.value != 1.0:
            pass
        seen.append(cell.value)

    reader = threading.Thread(target=read)
    reader.start()
    saved = sys.getswitchinterval()
    sys.setswitchinterval(100.0)
    try:
        go.set()
        run(inputs)
    finally:
        sys.setswitchinterval(saved)
        reader.join()
    assert seen == [0.0, 1.0], f"flag as the reader saw it first and last: {seen}"


def test_held_keeps_torchs_call_and_a_bad_choice_is_refused(package, monkeypatch):
    monkeypatch.setenv(released.ENV, "held")
    assert released.released_run(package.loader) is None
    assert "FLARE_COMPILED_CALL=held" in released.prepare()
    monkeypatch.setenv(released.ENV, "sometimes")
    with pytest.raises(released.CompiledCallChoiceError, match="not one of released, held"):
        released.choice()


def test_an_object_that_is_not_torchs_loader_gets_no_released_call(package):
    class StandIn:
        def boxed_run(self, flat):
            return tuple(flat)

    assert released.released_run(StandIn()) is None
    assert released.released_run(package.loader) is not None, "a stand-in turned the released call off"
