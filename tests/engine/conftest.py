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
