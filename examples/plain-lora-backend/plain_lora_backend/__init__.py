"""An example lora-conformance backend: the LoRA kernel ops in plain torch (see ``target``)."""

from .target import PlainExampleTarget

__all__ = ["PlainExampleTarget"]
