"""The serving level: a target driven the way a server drives it (design: judged as a backend serves).

One target instance built once with fixed capacities, persistent buffers, batches padded to captured
sizes, graphs captured and replayed, adapters loaded and evicted in place, step after step
(``docs/serving.md``). The level's kind is ``conformance.levels.serving``; here are its parts: the case
(``case``), the scenarios that draw cases (``scenarios``), the values drawn in the referee (``values``), the
target's half (``driver``) and the judgement (``judgement``).
"""

from .case import GRAPH_POLICIES, MODES, ServingCase, ServingStep
from .scenarios import SCENARIOS, SERVING_OPS, serving_case, serving_cases

__all__ = ["GRAPH_POLICIES", "MODES", "SCENARIOS", "SERVING_OPS", "ServingCase", "ServingStep", "serving_case", "serving_cases"]
