"""Custom torch ops that Flare's prepared programs call.

Importing this package registers every op under the ``flare::`` namespace
(idempotent: Python imports each module once). Both ``ignition`` (at capture)
and ``helios`` (before loading programs) import it; it holds no model code.

Each op has a fake kernel so ``torch.export`` can trace it, and a CPU kernel
whose work follows the real sequence lengths rather than the program's fixed
capacities. A CUDA kernel is added by registering another implementation for
the ``"cuda"`` device on the same op (see ``kv_cache.py``).
"""

from helios.ops import attention, kv_cache, slot_state  # noqa: F401  (registers the ops)
from helios.ops.layout import PackedRows

__all__ = ["PackedRows", "attention", "kv_cache", "slot_state"]
