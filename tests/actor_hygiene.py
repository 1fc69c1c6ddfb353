"""A fixture for test directories whose tests start actors themselves."""

import pykka
import pytest


@pytest.fixture(autouse=True)
def no_actor_outlives_its_test():
    """Every actor a test starts is stopped by its teardown (CONVENTIONS.md, rule 10)."""
    before = set(pykka.ActorRegistry.get_all())
    yield
    left = [ref for ref in pykka.ActorRegistry.get_all() if ref not in before]
    for ref in left:
        ref.stop(block=True)
    assert not left, f"actors still running after the test: {left}"
