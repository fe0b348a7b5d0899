"""Custom torch ops that Flare's prepared programs call.

Importing this package registers every op under the ``flare::`` namespace
(idempotent: Python imports each module once). Both ``ignition`` (at capture)
and ``helios`` (before loading programs) import it; it holds no model code.

Each op has a fake kernel so ``torch.export`` can trace it, and a CPU kernel
whose work follows the real sequence lengths rather than the program's fixed
capacities. The kernels are registered for ``device_types="cpu"``; a CUDA
kernel joins the same op with ``torch.library.register_kernel(
"flare::write_kv", "cuda", fn)`` (and likewise for the others), so programs
exported on either device call the same op names.
"""

from helios.ops import attention, kv_cache, slot_state  # noqa: F401  (registers the ops)
from helios.ops.layout import PackedRows

__all__ = ["PackedRows", "attention", "kv_cache", "slot_state"]
