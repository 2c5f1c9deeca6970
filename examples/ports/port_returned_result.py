"""A platform that cannot update in place: its wrapper returns the new y, and vLLM's layers use that (docs/ports.md §3)."""

import torch
from vllm_wrapper_backend.wrapper import FixedPunicaWrapperCPU

from conformance.targets.vllm_wrapper import VllmPunicaWrapperTarget


class ReturningWrapper(FixedPunicaWrapperCPU):
    """Each LoRA method leaves the y it is given as it was and returns the new one."""

    def add_shrink(self, y, x, lora_a_stacked, scale, **kwargs):
        new = y.clone()
        FixedPunicaWrapperCPU.add_shrink(self, new, x, lora_a_stacked, scale)
        return new

    def add_expand(self, y, x, lora_b_stacked, output_slices, offset_start=0, add_inputs=True, **kwargs):
        new = y.clone()
        FixedPunicaWrapperCPU.add_expand(self, new, x, lora_b_stacked, output_slices, offset_start, add_inputs)
        return new

    def add_lora_linear(self, y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, *, buffer=None,
                        add_inputs=True, **kwargs):
        x = x.view(-1, x.shape[-1])
        if buffer is None:
            buffer = torch.zeros(len(output_slices), x.size(0), lora_b_stacked[0].size(-1), dtype=torch.float32)
        buffer = self.add_shrink(buffer, x, lora_a_stacked, scale)  # as vLLM's layers do: the returned buffer
        return self.add_expand(y, buffer, lora_b_stacked, output_slices, add_inputs=add_inputs)

    def add_lora_embedding(self, y, x, lora_b_stacked, add_inputs=True, **kwargs):
        new = y.clone()
        FixedPunicaWrapperCPU.add_lora_embedding(self, new, x, lora_b_stacked, add_inputs)
        return new

    def add_lora_logits(self, y, x, lora_a_stacked, lora_b_stacked, scale, *, buffer=None, **kwargs):
        new = y.clone()
        FixedPunicaWrapperCPU.add_lora_logits(self, new, x, lora_a_stacked, lora_b_stacked, scale, buffer=buffer)
        return new


class ReturnedResultPort(VllmPunicaWrapperTarget):
    name = "port-returned-result"
    dtypes = frozenset({torch.float32})
    wrapper_class = ReturningWrapper
    can_update_inplace = False  # the platform's answer to vLLM's current_platform.can_update_inplace()
