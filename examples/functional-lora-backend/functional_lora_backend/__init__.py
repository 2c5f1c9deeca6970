"""An example lora-conformance backend: the dense LoRA kernel ops in NumPy, written functionally (see ``target``)."""

from .target import FunctionalExampleTarget

__all__ = ["FunctionalExampleTarget"]
