import pytest
from engine_helpers import assert_idle_and_nothing_leaked

from actorlm.llm import LLM


@pytest.fixture
def make_llm():
    """Build LLMs that are shut down (and checked for leaked blocks) after the test."""
    made = []

    def make(model, **flags):
        llm = LLM(model, **{"dtype": "float32", **flags})
        made.append(llm)
        return llm

    yield make
    for llm in made:
        try:
            assert_idle_and_nothing_leaked(llm)
        finally:
            llm.shutdown()


@pytest.fixture(scope="session")
def ray_cluster():
    """One small local Ray cluster for the session (the engine joins it: ray is initialised)."""
    import ray  # the ray extra: make install installs it
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
