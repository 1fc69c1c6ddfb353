"""An encoder embedding model (a tiny BERT laid out as all-MiniLM is) behind a real server,
driven by the official ``openai`` client: ``/v1/embeddings`` against sentence-transformers,
``/v1/score`` as the cosine of the two texts' vectors, a prompt past the model's 64 positions
refused in OpenAI's shape while the server keeps serving; and, without
``--served-model-name``, the model named by its path as given, as vLLM names it."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from api_helpers import openai_client, serving

TEXTS = ["Once upon a time", "The quick brown fox jumps over the lazy dog.",
         "1, 2, 3, 42 and 2024"]


@pytest.fixture(scope="module")
def bert(tiny_encoder_dirs):
    from sentence_transformers import SentenceTransformer

    path = tiny_encoder_dirs["bert_mean"]
    return path, SentenceTransformer(str(path), device="cpu").encode(TEXTS)


@pytest.fixture(scope="module")
def base_url(bert, tmp_path_factory):
    path, _ = bert
    log_path = tmp_path_factory.mktemp("encoder_server") / "server.log"
    with serving(path, log_path, "--served-model-name", "tiny-bert", "--dtype",
                 "float32") as (proc, base):
        yield base
        proc.terminate()
        proc.wait(timeout=20)


def test_embeddings_through_the_openai_client(bert, base_url):
    _, want = bert
    with openai_client(base_url) as client:
        result = client.embeddings.create(model="tiny-bert", input=TEXTS)
    got = np.array([d.embedding for d in result.data])
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert result.usage.prompt_tokens == sum(len(t) for t in _token_ids(base_url, TEXTS))


def test_score_is_the_cosine_of_the_two_vectors(bert, base_url):
    _, want = bert
    response = httpx.post(f"{base_url}/v1/score", json={"model": "tiny-bert", "text_1": TEXTS[0],
                                                         "text_2": TEXTS[1:]}, timeout=30)
    assert response.status_code == 200, response.text
    scores = [d["score"] for d in response.json()["data"]]
    cosines = [float(want[0] @ w / np.linalg.norm(want[0]) / np.linalg.norm(w)) for w in want[1:]]
    np.testing.assert_allclose(scores, cosines, atol=1e-5)


def test_a_prompt_past_the_positions_is_refused_and_the_server_serves_on(base_url):
    import openai

    with openai_client(base_url) as client:
        with pytest.raises(openai.BadRequestError) as refused:
            client.embeddings.create(model="tiny-bert", input="bread " * 80)
        assert "64" in str(refused.value)  # the model's positions, named
        assert len(client.embeddings.create(model="tiny-bert", input=TEXTS[0]).data) == 1


def _token_ids(base_url, texts) -> list[list[int]]:
    return [httpx.post(f"{base_url}/tokenize", json={"model": "tiny-bert", "prompt": t},
                       timeout=30).json()["tokens"] for t in texts]


def test_without_a_served_name_the_path_as_given_names_the_model(bert, tmp_path):
    path, want = bert
    with serving(path, tmp_path / "server.log", "--dtype", "float32") as (proc, base):
        with openai_client(base) as client:
            assert [m.id for m in client.models.list().data] == [path.name]
            for name in (str(path), path.name):
                got = client.embeddings.create(model=name, input=TEXTS[0]).data[0].embedding
                np.testing.assert_allclose(got, want[0], atol=1e-5)
        proc.terminate()
        proc.wait(timeout=20)


def test_a_cross_encoder_reranks_documents(tiny_encoder_classifiers, tmp_path):
    """BGE's rerankers' and ms-marco's shape: ``/rerank`` of a query against documents, best
    first, each score the pair's probability as transformers gives it."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = tiny_encoder_classifiers["bert_cross"]
    query, documents = "Who baked bread?", ["The old baker.", "A lazy dog.", "Machine learning."]
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path)
    with torch.no_grad():
        want = [float(model(**tokenizer(query, d, return_tensors="pt")).logits.sigmoid())
                for d in documents]
    with serving(path, tmp_path / "server.log", "--dtype", "float32") as (proc, base):
        response = httpx.post(f"{base}/v1/rerank", json={"query": query, "documents": documents},
                              timeout=30)
        proc.terminate()
        proc.wait(timeout=20)
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert [r["index"] for r in results] == sorted(range(3), key=lambda i: -want[i])
    np.testing.assert_allclose([r["relevance_score"] for r in results], sorted(want)[::-1],
                               atol=1e-5)
