"""What capture needs from a model, independent of where the model comes from.

``write_catalog`` consumes a ``CaptureSource``; ``ignition.capture.model_source``
builds one from a recipe, its capacity plan and a checkpoint, and tests build
one from a stand-in module. Keeping this seam narrow keeps the writer free of
model code.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flare_contract.graphs import GraphDescriptor
from flare_contract.manifest import Envelope
from ignition.capture.export import ProgramSpecLike


@dataclass(frozen=True)
class CaptureSource:
    """A model ready to capture: plain-data metadata, weights and a program builder."""

    recipe: Mapping[str, Any]  # the resolved recipe, as plain data
    model: Mapping[str, Any]  # model config, as plain data
    tokenizer_reference: str  # where the tokenizer came from (no host paths)
    tokenizer_files: tuple[Path, ...]
    device: Mapping[str, Any]  # {"kind": "cpu", "dtype": "float32"}
    envelope: Envelope
    layout: Mapping[str, Any]  # state layout parameters (request_slots, page_size, ...)
    weights: Mapping[str, Mapping[str, torch.Tensor]]  # weight set name -> tensors, in key order
    graphs: tuple[GraphDescriptor, ...]
    build: Callable[[GraphDescriptor], ProgramSpecLike]
    # A picklable factory that recreates this source in another process, so
    # programs can be exported in parallel worker processes; None: serial only.
    rebuild: Callable[[], "CaptureSource"] | None = None
