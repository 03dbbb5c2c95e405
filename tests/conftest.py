"""Hypothesis profiles. `make test` uses "ci" (quick); HYPOTHESIS_PROFILE=thorough runs longer.

No example database in the repo: campaigns keep theirs under their output directory.
"""

import os

from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=40, stateful_step_count=50, deadline=None, database=None, derandomize=True,
                          suppress_health_check=list(HealthCheck), print_blob=True)
settings.register_profile("thorough", max_examples=1000, stateful_step_count=150, deadline=None, database=None,
                          suppress_health_check=list(HealthCheck), print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
