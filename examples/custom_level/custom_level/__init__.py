"""A third-party level of the lora-conformance contract: float32 sums on the target's device."""
