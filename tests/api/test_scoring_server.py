"""``/classify``, ``/score`` and ``/rerank`` on real servers: a three-label classifier and a
cross-encoder against transformers' ``AutoModelForSequenceClassification`` (one input at a time,
pairs joined by the tokenizer on both sides), an embedding model against sentence-transformers'
vectors; the refusals in OpenAI's shape, each followed by a request that still succeeds.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
from api_helpers import serving

TEXTS = ["The quick brown fox", "Once upon a time there was a small village at the edge of a "
         "great forest.", "Questions and answers, numbers like 1, 2, 3, 42 and 2024."]
QUERY, DOCS = "The quick brown fox", ["A lazy dog sleeps", *TEXTS[1:], "fox"]
ATOL = 1e-4  # float32 on both sides
NAME = "tiny-pooler"


def _start(path, tmp_path_factory, tag: str):
    log_path = tmp_path_factory.mktemp(tag) / "server.log"
    with serving(path, log_path, "--num-kv-blocks", "128",
                 "--served-model-name", NAME) as (proc, base):
        yield base
        proc.terminate()
        proc.wait(timeout=20)


@pytest.fixture(scope="module")
def labels_server(tiny_classifier_dirs, tmp_path_factory):
    yield from _start(tiny_classifier_dirs["qwen3_labels"], tmp_path_factory, "labels_server")


@pytest.fixture(scope="module")
def cross_server(tiny_classifier_dirs, tmp_path_factory):
    yield from _start(tiny_classifier_dirs["llama_cross"], tmp_path_factory, "cross_server")


@pytest.fixture(scope="module")
def embed_server(tiny_embedding_dirs, tmp_path_factory):
    yield from _start(tiny_embedding_dirs["qwen3_last"], tmp_path_factory, "embed_server")


def _oracle(path, *texts) -> tuple[torch.Tensor, list[int]]:
    """(transformers' logits of each input or pair, each one's number of tokens)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    encoded = [tokenizer(*x) for x in zip(*texts)]
    with torch.no_grad():
        logits = torch.cat([model(**{k: torch.tensor([v]) for k, v in x.items()}).logits
                            for x in encoded])
    return logits, [len(x["input_ids"]) for x in encoded]


@pytest.fixture(scope="module")
def cross_oracle(tiny_classifier_dirs) -> tuple[list[float], list[int]]:
    """(the cross-encoder's probability of each (QUERY, DOCS[i]), each pair's tokens)."""
    logits, num_tokens = _oracle(tiny_classifier_dirs["llama_cross"], [QUERY] * len(DOCS), DOCS)
    return logits[:, 0].sigmoid().tolist(), num_tokens


def _post(base: str, path: str, body: dict) -> dict:
    reply = httpx.post(base + path, json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _assert_refused(reply: httpx.Response, param: str | None, words: str) -> None:
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert error["param"] == param and words in error["message"], error


# --- the oracle's answers -------------------------------------------------------------------------


def test_classify_equals_the_oracle_in_input_order(labels_server, tiny_classifier_dirs):
    logits, num_tokens = _oracle(tiny_classifier_dirs["qwen3_labels"], TEXTS)
    reply = _post(labels_server, "/classify", {"model": NAME, "input": TEXTS})
    assert reply["object"] == "list" and reply["model"] == NAME
    assert reply["id"].startswith("classify-")
    assert [d["index"] for d in reply["data"]] == [0, 1, 2]
    probs = logits.softmax(-1)
    np.testing.assert_allclose([d["probs"] for d in reply["data"]], probs, atol=ATOL, rtol=0)
    names = ["sad", "calm", "glad"]
    assert [d["label"] for d in reply["data"]] == [names[i] for i in probs.argmax(-1)]
    assert len(set(d["label"] for d in reply["data"])) > 1  # the test can tell labels apart
    assert all(d["num_classes"] == 3 for d in reply["data"])
    assert reply["usage"] == {"prompt_tokens": sum(num_tokens), "total_tokens": sum(num_tokens)}
    # one text, and token ids, give the same answer
    ids = _post(labels_server, "/tokenize", {"prompt": TEXTS[1]})["tokens"]
    for one in (TEXTS[1], ids):
        data = _post(labels_server, "/classify", {"input": one})["data"]
        np.testing.assert_allclose(data[0]["probs"], probs[1], atol=ATOL, rtol=0)


def test_classify_reads_a_conversation_through_the_chat_template(labels_server,
                                                                 tiny_classifier_dirs):
    from transformers import AutoTokenizer

    path = tiny_classifier_dirs["qwen3_labels"]
    messages = [{"role": "user", "content": TEXTS[0]}, {"role": "assistant", "content": TEXTS[1]}]
    text = AutoTokenizer.from_pretrained(path).apply_chat_template(messages, tokenize=False)
    logits, num_tokens = _oracle(path, [text])
    reply = _post(labels_server, "/classify", {"messages": messages})
    np.testing.assert_allclose(reply["data"][0]["probs"], logits.softmax(-1)[0], atol=ATOL,
                               rtol=0)
    assert reply["usage"]["prompt_tokens"] == num_tokens[0]


def test_pooling_and_use_activation_on_a_classifier(labels_server, tiny_classifier_dirs):
    logits, _ = _oracle(tiny_classifier_dirs["qwen3_labels"], TEXTS)
    pooled = _post(labels_server, "/pooling", {"input": TEXTS})
    np.testing.assert_allclose([d["data"] for d in pooled["data"]], logits.softmax(-1),
                               atol=ATOL, rtol=0)
    raw = _post(labels_server, "/classify", {"input": TEXTS, "use_activation": False})
    np.testing.assert_allclose([d["probs"] for d in raw["data"]], logits, atol=1e-4, rtol=0)
    raw = _post(labels_server, "/pooling", {"input": TEXTS, "use_activation": False})
    np.testing.assert_allclose([d["data"] for d in raw["data"]], logits, atol=1e-4, rtol=0)


def test_cross_encoder_scores_are_the_sigmoid_of_the_oracle(cross_server, cross_oracle):
    expected, num_tokens = cross_oracle
    one_to_many = _post(cross_server, "/score", {"model": NAME, "text_1": QUERY, "text_2": DOCS})
    pairwise = _post(cross_server, "/v1/score", {"text_1": [QUERY] * len(DOCS), "text_2": DOCS})
    for reply in (one_to_many, pairwise):
        assert reply["id"].startswith("score-") and reply["object"] == "list"
        assert [(d["index"], d["object"]) for d in reply["data"]] == \
            [(i, "score") for i in range(len(DOCS))]
        np.testing.assert_allclose([d["score"] for d in reply["data"]], expected, atol=ATOL,
                                   rtol=0)
        assert reply["usage"]["prompt_tokens"] == sum(num_tokens)
    assert max(expected) - min(expected) > 0.01  # the pairs differ: the order means something


@pytest.mark.parametrize("path, top_n", [("/rerank", None), ("/v1/rerank", 2),
                                         ("/v2/rerank", 0)])
def test_rerank_is_best_first_and_cut_to_top_n(cross_server, cross_oracle, path, top_n):
    expected, num_tokens = cross_oracle
    body = {"model": NAME, "query": QUERY, "documents": DOCS}
    reply = _post(cross_server, path, body if top_n is None else {**body, "top_n": top_n})
    assert reply["id"].startswith("rerank-") and reply["model"] == NAME
    assert reply["usage"] == {"total_tokens": sum(num_tokens)}
    order = sorted(range(len(DOCS)), key=lambda i: -expected[i])[:top_n or None]
    results = reply["results"]
    assert [r["index"] for r in results] == order
    assert [r["document"]["text"] for r in results] == [DOCS[i] for i in order]
    np.testing.assert_allclose([r["relevance_score"] for r in results],
                               [expected[i] for i in order], atol=ATOL, rtol=0)


def test_embedding_model_scores_by_cosine(embed_server, tiny_embedding_dirs):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(tiny_embedding_dirs["qwen3_last"]), device="cpu")
    vectors = st.encode([QUERY, *DOCS], convert_to_numpy=True)
    cosines = [float(v @ vectors[0] / np.linalg.norm(v) / np.linalg.norm(vectors[0]))
               for v in vectors[1:]]
    scores = _post(embed_server, "/score", {"text_1": QUERY, "text_2": DOCS})["data"]
    np.testing.assert_allclose([d["score"] for d in scores], cosines, atol=ATOL, rtol=0)
    ranked = _post(embed_server, "/rerank", {"query": QUERY, "documents": DOCS, "top_n": 3})
    order = sorted(range(len(DOCS)), key=lambda i: -cosines[i])[:3]
    assert [r["index"] for r in ranked["results"]] == order
    np.testing.assert_allclose([r["relevance_score"] for r in ranked["results"]],
                               [cosines[i] for i in order], atol=ATOL, rtol=0)


# --- refusals -------------------------------------------------------------------------------------

SCORE = {"text_1": QUERY, "text_2": DOCS}
RERANK = {"query": QUERY, "documents": DOCS}


@pytest.mark.parametrize("path, body, param, words", [
    ("/rerank", {"query": QUERY, "documents": []}, "documents", "at least one document"),
    ("/rerank", {"query": QUERY, "documents": DOCS, "top_n": -1}, "top_n", ">= 0"),
    ("/rerank", {"documents": DOCS}, "query", "missing required field"),
    ("/score", {"text_1": [QUERY, QUERY], "text_2": DOCS}, "text_1", "as many as text_2"),
    ("/score", {"text_1": QUERY, "text_2": []}, "text_2", "text_2 not empty"),
    ("/score", {"text_1": QUERY, "text_2": [1, 2]}, "text_2[0]", "Expected `str`"),
    ("/classify", {"input": []}, "input", "empty"),
    ("/classify", {"input": [10**6]}, "input", "outside the vocabulary"),
], ids=["no-documents", "top-n-negative", "no-query", "count-mismatch", "no-text-2",
        "token-ids-to-score", "classify-nothing", "outside-vocab"])
def test_bad_input_is_a_400_naming_the_field(cross_server, path, body, param, words):
    _assert_refused(httpx.post(cross_server + path, json=body, timeout=60), param, words)
    assert httpx.post(cross_server + "/score", json=SCORE, timeout=60).status_code == 200


def test_a_classifier_of_several_labels_neither_scores_nor_embeds(labels_server):
    for path, body in [("/score", SCORE), ("/v2/rerank", RERANK)]:
        _assert_refused(httpx.post(labels_server + path, json=body, timeout=60), None,
                        "it classifies into 3 labels")
    _assert_refused(httpx.post(labels_server + "/v1/embeddings", json={"input": "x"}), None,
                    "The model does not support Embeddings API")
    assert httpx.post(labels_server + "/classify", json={"input": "x"}).status_code == 200


def test_a_model_that_does_not_classify_refuses_to(embed_server):
    _assert_refused(httpx.post(embed_server + "/classify", json={"input": "x"}), None,
                    "The model does not support Classification API")
    assert httpx.post(embed_server + "/v1/embeddings", json={"input": "x"}).status_code == 200


def test_openapi_lists_the_routes(cross_server):
    paths = httpx.get(cross_server + "/openapi.json").json()["paths"]
    for path, request in [("/classify", "ClassificationRequest"), ("/score", "ScoreRequest"),
                          ("/v1/score", "ScoreRequest"), ("/rerank", "RerankRequest"),
                          ("/v1/rerank", "RerankRequest"), ("/v2/rerank", "RerankRequest")]:
        schema = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert schema["$ref"].endswith("/" + request)
