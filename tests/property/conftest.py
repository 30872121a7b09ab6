"""Hypothesis profiles: `ci` (default: seeded, few examples, a few minutes with the rest of the suite) and
`soak` (hundreds of examples, for a long run): ELASTIC_LOCAL_HYPOTHESIS=soak pytest tests/property."""

import os

from hypothesis import HealthCheck, settings

# every example builds, writes and loads real checkpoints: seconds each, so no per-example deadline
_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.register_profile("ci", max_examples=20, derandomize=True, print_blob=True, **_common)
settings.register_profile("soak", max_examples=300, print_blob=True, **_common)
settings.load_profile(os.environ.get("ELASTIC_LOCAL_HYPOTHESIS", "ci"))
