"""Custom torch ops that Flare's prepared programs call.

Importing this package defines every op under the ``flare::`` namespace
(``schema``: schemas and fake kernels, so ``torch.export`` can trace them) and
installs their CPU kernels (the state programs' copies: ``state_copy``, Python only; the others: ``kernels``: native C++ built once per machine,
or the Python references in ``attention``, ``kv_cache``, ``linear``, ``sampling`` and ``slot_state``;
``FLARE_OPS_KERNELS`` chooses). Both kernels do work that follows the real
sequence lengths rather than the program's fixed capacities. Both ``ignition``
(at capture) and ``helios`` (before loading programs) import it; it holds no
model code. A CUDA kernel joins the same op with
``torch.library.register_kernel("flare::write_kv", "cuda", fn)`` (and likewise
for the others), so programs exported on either device call the same op names.
"""

from helios.ops import schema  # noqa: F401  (defines the ops)
from helios.ops import attention, kernels, kv_cache, sampling, slot_state, state_copy
from helios.ops.layout import PackedRows

kernels.install()

__all__ = ["PackedRows", "attention", "kernels", "kv_cache", "sampling", "schema", "slot_state", "state_copy"]
