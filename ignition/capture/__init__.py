"""Capture: turn each planned shape into a program and write the catalog folder.

``capture(request)`` is the whole pipeline (recipe -> plan -> model -> catalog);
``write_catalog(source, out)`` is its writer, usable with any ``CaptureSource``;
``inspect_catalog(path)`` summarizes a catalog for ``ignition inspect``.
"""

from ignition.capture.build import (
    COMPILE_MODES,
    CaptureError,
    CaptureObserver,
    CaptureSummary,
    write_catalog,
)
from ignition.capture.inspect import CatalogReport, inspect_catalog
from ignition.capture.pipeline import CaptureRequest, capture
from ignition.capture.source import CaptureSource
from ignition.capture.staging import StagingError

__all__ = [
    "COMPILE_MODES",
    "CaptureError",
    "CaptureObserver",
    "CaptureRequest",
    "CaptureSource",
    "CaptureSummary",
    "CatalogReport",
    "StagingError",
    "capture",
    "inspect_catalog",
    "write_catalog",
]
