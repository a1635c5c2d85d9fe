"""Hypothesis profiles shared by the differential fuzz suites (GEMM now, convolution next).

* ``ci`` (the default): a few hundred examples per test, derandomised -- every run
  of the same code draws the same examples, so a CI failure reproduces locally and
  a green run means the same thing twice.  No example database, for the same reason.
* ``long``: ``TILEGEMM_FUZZ=long`` in the environment.  Many more examples, seeded
  afresh each run (so repeated long runs explore new ground); a failure prints the
  ``@reproduce_failure`` blob to replay it.

Profiles are registered here rather than loaded globally, so that loading this
module never changes the settings of other test files: fuzz tests opt in with
``@fuzz_settings()`` (which also scales the example count per test).
"""
import os

from hypothesis import HealthCheck, settings

_COMMON = dict(
    deadline=None,          # first calls compile or load kernels; timing is not the point
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

settings.register_profile("ci", max_examples=200, derandomize=True, database=None, **_COMMON)
settings.register_profile("long", max_examples=5000, derandomize=False, **_COMMON)

PROFILES = ("ci", "long")


def profile_name():
    """The profile chosen by ``TILEGEMM_FUZZ`` (``ci`` when unset)."""
    name = os.environ.get("TILEGEMM_FUZZ", "").strip().lower() or "ci"
    if name not in PROFILES:
        raise ValueError(f"TILEGEMM_FUZZ must be one of {PROFILES}, got {name!r}")
    return name


def fuzz_settings(scale=1.0, **overrides):
    """A ``settings`` decorator from the selected profile, with ``max_examples`` times ``scale``.

    ``scale`` lets one file share its time budget among several fuzz tests
    (e.g. 0.5 for a test whose examples cost twice as much).
    """
    base = settings.get_profile(profile_name())
    count = max(1, int(round(base.max_examples * scale)))
    return settings(base, max_examples=overrides.pop("max_examples", count), **overrides)
