"""A per-call context: the framework is entered around every op call, not inside each op (docs/ports.md §2)."""

import contextlib

import torch

from conformance.targets.functional import FunctionalKernelTarget, functional_op

ENTERED = []  # the stand-in framework's state: non-empty while its context is entered


@contextlib.contextmanager
def framework_context():
    """What ``torchax.default_env()`` or a device scope would be: the ops run only inside it."""
    ENTERED.append(True)
    try:
        yield
    finally:
        ENTERED.pop()


class CallContextPort(FunctionalKernelTarget):
    name = "port-call-context"
    dtypes = frozenset({torch.float32})

    def call_context(self, op):
        return framework_context()  # entered by the suite around each call of each op and its update_metadata

    @functional_op
    def bgmv_shrink(self, inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling=1.0):
        if not ENTERED:
            raise RuntimeError("bgmv_shrink ran outside the framework's context")
        a = lora_a_weights.squeeze(1) if lora_a_weights.ndim == 4 else lora_a_weights
        slots = lora_indices_tensor.long()
        per_row = a[slots.clamp(min=0)].float()  # [T, R, H]
        delta = scaling * torch.einsum("th,trh->tr", inputs.float(), per_row) * (slots >= 0)[:, None]
        new = output_tensor.clone()
        new[:, : a.size(1)] += delta
        return new
