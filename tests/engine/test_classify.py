"""Classifiers and scores from a pooling model, against transformers on the same checkpoint.

The oracle is transformers' ``AutoModelForSequenceClassification`` (its score head on the last
token's state), one prompt at a time; a cross-encoder's pairs are joined by the tokenizer on
both sides. Prompts prefill in chunks of 16 tokens.
"""

from __future__ import annotations

import pytest
import torch

from actorlm import LLM, PoolingParams

PROMPTS = ["The quick brown fox", "Once upon a time there was a small village at the edge of a "
           "great forest, and in that village lived an old baker who rose every morning.",
           "Questions and answers, numbers like 1, 2, 3, 42 and 2024."]
FLAGS = dict(dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16, max_num_seqs=4)


def _oracle_logits(path, inputs: list[dict]) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        return torch.cat([model(**{k: torch.tensor([v]) for k, v in x.items()}).logits
                          for x in inputs]).float()


def _encoded(path, *texts) -> list[dict]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    return [dict(tokenizer(*pair)) for pair in zip(*texts)]


def test_classify_matches_transformers(tiny_classifier_dirs):
    path = tiny_classifier_dirs["qwen3_labels"]
    logits = _oracle_logits(path, _encoded(path, PROMPTS))
    with LLM(str(path), **FLAGS) as llm:
        assert llm.config.is_pooling and llm.config.pooler_config.task == "classify"
        probs = llm.classify(PROMPTS, use_tqdm=False)
        raw = llm.classify(PROMPTS, PoolingParams(use_activation=False), use_tqdm=False)
        with pytest.raises(ValueError, match="does classify, not embed"):
            llm.embed(PROMPTS[0])
        with pytest.raises(ValueError, match="apply to embeddings"):
            llm.classify(PROMPTS[0], PoolingParams(dimensions=2))
        with pytest.raises(ValueError, match="score needs a cross-encoder"):
            llm.score(PROMPTS[0], PROMPTS[1])
        encoded = llm.encode(PROMPTS, use_tqdm=False)  # vLLM's generic call: the model's task
        with pytest.raises(ValueError, match="'token_classify' is not implemented"):
            llm.encode(PROMPTS[0], pooling_task="token_classify")
        with pytest.raises(ValueError, match="does classify, not embed"):
            llm.encode(PROMPTS[0], pooling_task="embed")
        stats = llm.stats()
    assert [o.outputs.num_classes for o in probs] == [3, 3, 3]
    torch.testing.assert_close(torch.tensor([o.outputs.probs for o in raw]), logits,
                               atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(torch.tensor([o.outputs.probs for o in probs]),
                               logits.softmax(-1), atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(torch.stack([o.outputs.data for o in encoded]),
                               logits.softmax(-1), atol=2e-6, rtol=1e-5)
    assert logits.softmax(-1).max(-1).values.min() < 0.99  # not saturated: the test can see
    assert stats["num_requests_holding_blocks"] == 0


def test_cross_encoder_scores_pairs(tiny_classifier_dirs):
    """One label: ``score`` joins each pair as the tokenizer does and gives the sigmoid of
    the logit; one text against several, or position by position (vLLM's pairing)."""
    path = tiny_classifier_dirs["llama_cross"]
    query, docs = "The quick brown fox", PROMPTS[1:] + ["A lazy dog"]
    logits = _oracle_logits(path, _encoded(path, [query] * len(docs), docs))[:, 0]
    with LLM(str(path), **FLAGS) as llm:
        scores = llm.score(query, docs, use_tqdm=False)
        pairwise = llm.score([query] * len(docs), docs, use_tqdm=False)
        with pytest.raises(ValueError, match="must be one text or as many as"):
            llm.score([query, query], docs)
    got = torch.tensor([s.outputs.score for s in scores])
    torch.testing.assert_close(got, logits.sigmoid(), atol=2e-6, rtol=1e-5)
    # the same pairs; the second call finds them in the prefix cache and computes only their
    # last token, which may round differently in the last bits (it does on a Zen 4)
    torch.testing.assert_close(torch.tensor([s.outputs.score for s in pairwise]), got,
                               atol=1e-6, rtol=0)
    assert got.max() - got.min() > 0.01  # the pairs differ


def test_embedding_model_scores_by_cosine(tiny_embedding_dirs):
    from sentence_transformers import SentenceTransformer

    path = tiny_embedding_dirs["qwen3_last"]
    vectors = SentenceTransformer(str(path), device="cpu").encode(PROMPTS, convert_to_tensor=True)
    with LLM(str(path), **FLAGS) as llm:
        scores = llm.score(PROMPTS[0], PROMPTS, use_tqdm=False)
        with pytest.raises(ValueError, match="does embed, not classify"):
            llm.classify(PROMPTS[0])
    want = torch.nn.functional.cosine_similarity(vectors[:1], vectors)
    torch.testing.assert_close(torch.tensor([s.outputs.score for s in scores]), want.float(),
                               atol=2e-6, rtol=1e-5)


def test_convert_must_agree_with_the_checkpoint(tiny_classifier_dirs, tiny_qwen3_dir):
    with pytest.raises(ValueError, match="--convert classify: this checkpoint is a "
                                         "Qwen3ForCausalLM, which can only embed"):
        LLM(str(tiny_qwen3_dir), convert="classify", **FLAGS)
    with pytest.raises(ValueError, match="--convert embed: this checkpoint is a "
                                         "Qwen3ForSequenceClassification"):
        LLM(str(tiny_classifier_dirs["qwen3_labels"]), convert="embed", **FLAGS)


@pytest.mark.parametrize("flags", [{"tensor_parallel_size": 2}], ids=["tp2"])
def test_classify_under_tensor_parallelism(flags, tiny_classifier_dirs):
    """Each rank holds the whole score head; rank 0 classifies."""
    path = tiny_classifier_dirs["qwen3_labels"]
    logits = _oracle_logits(path, _encoded(path, PROMPTS))
    with LLM(str(path), **flags, **FLAGS) as llm:
        probs = torch.tensor([o.outputs.probs for o in llm.classify(PROMPTS, use_tqdm=False)])
    torch.testing.assert_close(probs, logits.softmax(-1), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("checkpoint, architecture", [
    ("tiny_qwen3_dir", "Qwen3ForSequenceClassification"),
    ("tiny_llama_dir", "LlamaForSequenceClassification")])  # (its LM head tied: the embedding's)
def test_a_causal_lm_reranks_by_two_tokens_logits(checkpoint, architecture, request):
    """Qwen3-Reranker's way (vLLM's ``classifier_from_token`` override): the causal LM's
    logits of two tokens at the prompt's last position, read as one label whose sigmoid is
    the second token's share of their softmax; or, without the two-way softmax, one label
    per token. The oracle is transformers' causal LM itself."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    lm_dir = request.getfixturevalue(checkpoint)

    tokenizer = AutoTokenizer.from_pretrained(lm_dir)
    no, yes = (tokenizer.convert_ids_to_tokens(i) for i in (37, 41))
    model = AutoModelForCausalLM.from_pretrained(lm_dir).eval()
    with torch.no_grad():
        logits = torch.stack([model(torch.tensor([tokenizer(p)["input_ids"]])).logits[0, -1]
                              for p in PROMPTS])[:, [37, 41]]
    overrides = {"architectures": [architecture], "classifier_from_token": [no, yes]}
    with LLM(str(lm_dir), hf_overrides={**overrides, "is_original_qwen3_reranker": True},
             **FLAGS) as llm:
        assert llm.config.pooler_config.task == "classify"
        two_way = torch.tensor([o.outputs.probs for o in llm.classify(PROMPTS, use_tqdm=False)])
        scores = [s.outputs.score for s in llm.score(PROMPTS[0], PROMPTS[1:], use_tqdm=False)]
    torch.testing.assert_close(two_way[:, 0], logits.softmax(-1)[:, 1], atol=2e-6, rtol=1e-5)
    assert len(scores) == 2 and all(0 < s < 1 for s in scores)
    with LLM(str(lm_dir), hf_overrides=overrides, **FLAGS) as llm:
        both = torch.tensor([o.outputs.probs for o in llm.classify(PROMPTS, use_tqdm=False)])
    torch.testing.assert_close(both, logits.softmax(-1), atol=2e-6, rtol=1e-5)
    for bad, named in (({"classifier_from_token": [no]}, "two-way softmax takes two tokens"),
                       ({"method": "from_3_way"}, "method 'from_3_way' is not implemented"),
                       ({"architectures": ["LlamaForCausalLM"]}, "ForSequenceClassification")):
        with pytest.raises(ValueError, match=named):
            LLM(str(lm_dir), hf_overrides={**overrides, "is_original_qwen3_reranker": True,
                                                   **bad}, **FLAGS)
