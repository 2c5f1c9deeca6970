"""Benchmarks of the suite: the LoRA ops and the MoE LoRA ops at real model shapes, and the suite's own wall time.

``python -m benchmarks`` runs all three and writes ``docs/benchmarks.md`` (ops),
``docs/benchmarks-moe.md`` (MoE) and ``docs/benchmarks-suite.md`` (the suite);
``python -m benchmarks ops|moe|suite`` runs one part;
``--quick`` a few-minute subset; ``--smoke-test`` tiny shapes, for CI. Nothing here asserts a time:
these are measurements to record, not tests.
"""
