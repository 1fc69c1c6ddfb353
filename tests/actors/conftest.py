import pytest
from actor_hygiene import no_actor_outlives_its_test  # noqa: F401  (autouse)

from actorlm.testing import EngineHarness, ManualClock, TestProbe


@pytest.fixture
def clock():
    return ManualClock()


@pytest.fixture
def make_harness(clock):
    """Build EngineHarnesses (on the test's ManualClock) that are closed after the test."""
    made = []

    def make(**kwargs):
        harness = EngineHarness(**{"clock": clock, **kwargs})
        made.append(harness)
        return harness

    yield make
    for harness in made:
        harness.close()


@pytest.fixture
def make_probe():
    made = []

    def make(name="probe"):
        probe = TestProbe(name)
        made.append(probe)
        return probe

    yield make
    for probe in made:
        probe.stop()
