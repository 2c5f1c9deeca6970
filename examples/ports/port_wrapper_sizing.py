"""construct_wrapper: one wrapper kept across batches, sized as a server sizes it (docs/ports.md §4)."""

import torch
from vllm_wrapper_backend.wrapper import FixedPunicaWrapperCPU

from conformance.targets.vllm_wrapper import VllmPunicaWrapperTarget


class PooledWrapper(FixedPunicaWrapperCPU):
    """A wrapper whose constructor needs one more argument than vLLM's: its slot count."""

    def __init__(self, max_num_batched_tokens, max_batches, device, *, max_loras, **kwargs):
        super().__init__(max_num_batched_tokens, max_batches, device, **kwargs)
        self.capacity = (max_num_batched_tokens, max_batches, max_loras)


class PersistentWrapperPort(VllmPunicaWrapperTarget):
    name = "port-wrapper-sizing"
    dtypes = frozenset({torch.float32})
    wrapper_class = PooledWrapper

    def __init__(self):
        super().__init__()
        self.kept = None

    def construct_wrapper(self, mapping):
        tokens = max(len(mapping.token_slots), len(mapping.sampled_slots))  # sampled rows use the token buffers too
        needed = (tokens, len(mapping.seq_lens), mapping.num_slots)
        if self.kept is None or any(n > c for n, c in zip(needed, self.kept.capacity)):
            # a server builds one wrapper for its max_num_batched_tokens, max_num_seqs and max_loras; the suite's
            # batches vary, so grow to the next power of two when one does not fit
            size = [1 << max(n - 1, 0).bit_length() for n in needed]
            self.kept = PooledWrapper(size[0], size[1], self.device, max_loras=size[2])
        return self.kept  # update_metadata then rewrites every per-batch state of the kept wrapper
