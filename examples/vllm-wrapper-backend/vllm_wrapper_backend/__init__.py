"""An example of judging a vLLM ``PunicaWrapper`` subclass as it is (see ``target`` and ``wrapper``).

Importing the package does not import vLLM: the target names its wrapper class by ``module:Class``,
which the suite imports when it checks that the target can run.
"""

from .target import VllmWrapperExampleTarget

__all__ = ["VllmWrapperExampleTarget"]
