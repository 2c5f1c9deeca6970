"""token_lora_slots: the tokens' slots for the token classification head (docs/ports.md §5)."""

import torch
from vllm_wrapper_backend.wrapper import FixedPunicaWrapperCPU

from conformance.targets.vllm_wrapper import VllmPunicaWrapperTarget


class BucketedWrapper(FixedPunicaWrapperCPU):
    """A platform that pads every batch to a bucket of rows: its token indices cover the bucket, −1 past the batch."""

    @property
    def token_lora_indices(self):
        tokens = self.indices_len[0]
        padded = torch.full((1 << tokens.bit_length(),), -1, dtype=torch.long)
        padded[:tokens] = self._token_lora_indices[:tokens]
        return padded

    def _update_prefill_metadata(self, token_lora_tensor):
        super()._update_prefill_metadata(token_lora_tensor[: self.indices_len[0]])  # the batch's segments, not the bucket's


class TokenSlotsPort(VllmPunicaWrapperTarget):
    name = "port-token-slots"
    dtypes = frozenset({torch.float32})
    wrapper_class = BucketedWrapper

    def token_lora_slots(self):
        return self.wrapper.token_lora_indices[: len(self.mapping.token_slots)]  # one slot per token of the batch
