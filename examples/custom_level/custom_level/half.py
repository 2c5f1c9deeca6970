"""The target's half of a ``device_sum`` case: it runs in the target's worker process.

``serve(executor, request)``: ``executor.target`` is the loaded target; the request and the answer are
data (a dict of JSON values and tensors). The values came from the referee; the sum goes back as one
float32 tensor. Nothing here judges.
"""

from __future__ import annotations

import torch


def serve(executor, request: dict) -> dict:
    target = executor.target
    values = request["values"].to(target.device)
    total = torch.sum(values, dtype=torch.float32)
    target.synchronize()
    return {"sum": total.reshape(1).cpu()}
