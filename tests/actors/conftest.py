import pykka
import pytest

from actorlm.testing import EngineHarness, ManualClock, TestProbe


@pytest.fixture(autouse=True)
def no_actor_outlives_its_test():
    """Every actor a test starts is stopped by its teardown (CONVENTIONS.md, rule 10)."""
    before = set(pykka.ActorRegistry.get_all())
    yield
    left = [ref for ref in pykka.ActorRegistry.get_all() if ref not in before]
    for ref in left:
        ref.stop(block=True)
    assert not left, f"actors still running after the test: {left}"


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
