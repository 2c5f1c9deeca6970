"""The suite's own Hypothesis settings profile.

With ``CI=true`` in the environment Hypothesis loads its built-in ``ci`` profile unless another one is
loaded explicitly; the suite always loads this one, so local and CI runs behave the same: no deadline
(the first example pays for warm-up), derandomized, no example database (the replay files are the
record of failures).
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings

PROFILE = "lora-conformance"

settings.register_profile(
    PROFILE,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)


def load() -> None:
    settings.load_profile(PROFILE)
