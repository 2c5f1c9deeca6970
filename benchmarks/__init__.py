"""Benchmarks of the suite: the LoRA ops at real model shapes, and the suite's own wall time.

``python -m benchmarks`` runs both and writes ``docs/benchmarks.md`` (ops) and
``docs/benchmarks-suite.md`` (the suite); ``python -m benchmarks ops|suite`` runs one part;
``--quick`` a few-minute subset; ``--smoke-test`` tiny shapes, for CI. Nothing here asserts a time:
these are measurements to record, not tests.
"""
