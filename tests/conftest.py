"""Hypothesis profiles. `make test` uses "ci" (quick); HYPOTHESIS_PROFILE=thorough runs longer.

No example database in the repo: campaigns keep theirs under their output directory.
"""

import contextlib
import os

from hypothesis import HealthCheck, settings

from vtoken.fuzz.campaign import seed_only_generation

settings.register_profile("ci", max_examples=40, stateful_step_count=50, deadline=None, database=None, derandomize=True,
                          suppress_health_check=list(HealthCheck), print_blob=True)
settings.register_profile("thorough", max_examples=1000, stateful_step_count=150, deadline=None, database=None,
                          suppress_health_check=list(HealthCheck), print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Hypothesis also draws literals from every local module imported so far, so what a derandomized test generates
# would depend on which test files were collected and run before it (CI's whole suite against a developer's one
# file): pinned for the session, as campaigns pin it per batch (docs/fuzzing.md, "Determinism").
_pinned = contextlib.ExitStack()


def pytest_configure(config):
    _pinned.enter_context(seed_only_generation())


def pytest_unconfigure(config):
    _pinned.close()
