"""An example backend that implements vLLM's LoRA wrapper methods directly (docs/bring-up.md, "a full target")."""

from .target import FullTargetExample

__all__ = ["FullTargetExample"]
