"""Encoder models (BERT, XLM-RoBERTa, MPNet, DistilBERT, ModernBERT): embeddings against
sentence-transformers on the same directory (transformers runs the encoder, then its Pooling
and Normalize modules), the bare ``BertModel`` against transformers' own states, and
classifiers (cross-encoders) against transformers' ``...ForSequenceClassification``.

Prompts of several lengths in one step, and more prompts than fit one step, so that each
request's attention is held to its own rows; a step budget below a prompt's length would
chunk it, which an encoder must not do.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from actorlm import LLM
from encoder_models import ENCODER_MODELS

PROMPTS = ["The quick brown fox", "Once upon a time there was a small village at the edge of a "
           "great forest, and in that village lived an old baker.",
           "Questions and answers, numbers like 1, 2, 3, 42 and 2024.", "bread", "A journey of "
           "a thousand miles begins with a single step."]
FLAGS = dict(dtype="float32", max_num_seqs=3)


def _vectors(outputs) -> torch.Tensor:
    assert all(o.finished and o.error is None for o in outputs)
    return torch.tensor([o.outputs.embedding for o in outputs])


def _oracle(path, prompts=PROMPTS) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path), device="cpu").encode(
        prompts, convert_to_tensor=True).float().cpu()


def _cls_states(path, prompts=PROMPTS) -> torch.Tensor:
    """transformers' first-token state of each prompt, alone, normalized (vLLM's default
    pooling of a bare BERT)."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path)
    with torch.no_grad():
        states = [model(**tokenizer(p, return_tensors="pt")).last_hidden_state[0, 0]
                  for p in prompts]
    return torch.nn.functional.normalize(torch.stack(states), dim=-1)


@pytest.mark.parametrize("name", [n for n, (_, mode) in ENCODER_MODELS.items() if mode])
def test_embeddings_match_sentence_transformers(name, tiny_encoder_dirs):
    path = tiny_encoder_dirs[name]
    with LLM(str(path), **FLAGS) as llm:
        assert llm.config.is_pooling and not llm.config.enable_prefix_caching
        assert not llm.config.enable_chunked_prefill
        outputs = llm.embed(PROMPTS, use_tqdm=False)
        stats = llm.stats()
        tokens = [llm.tokenizer.encode(p) for p in PROMPTS]
    assert [o.prompt_token_ids for o in outputs] == tokens
    # (each wrapped in its special tokens, its words the vocabulary's)
    unknown = llm.tokenizer.unk_token_id
    assert all(t[0] != t[1] and t.count(unknown) <= len(t) // 4 for t in tokens), tokens
    torch.testing.assert_close(_vectors(outputs), _oracle(path), atol=2e-6, rtol=1e-5)
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_requests_holding_blocks"] == 0


def test_a_bare_bert_pools_its_first_token(tiny_encoder_dirs):
    """No sentence-transformers files: vLLM's default for BERT, the [CLS] state normalized."""
    path = tiny_encoder_dirs["bert_bare"]
    with LLM(str(path), **FLAGS) as llm:
        assert llm.config.pooler_config.pooling_type == "CLS"
        got = _vectors(llm.embed(PROMPTS, use_tqdm=False))
    torch.testing.assert_close(got, _cls_states(path), atol=2e-6, rtol=1e-5)


def test_bf16_is_close_to_fp32(tiny_encoder_dirs):
    path = tiny_encoder_dirs["bert_mean"]
    with LLM(str(path), dtype="bfloat16", max_num_seqs=3) as llm:
        got = _vectors(llm.embed(PROMPTS, use_tqdm=False))
    want = _oracle(path)
    assert torch.nn.functional.cosine_similarity(got, want).min() > 0.999


def test_what_an_encoder_does_not_do_is_refused_by_name(tiny_encoder_dirs):
    path = tiny_encoder_dirs["bert_bare"]
    with pytest.raises(ValueError, match="encoder.*generating text is not implemented"):
        LLM(str(path), runner="generate", dtype="float32")
    with pytest.raises(ValueError, match="tensor parallelism of an encoder"):
        LLM(str(path), tensor_parallel_size=2, dtype="float32")


QUERY = "What did the baker share?"
DOCUMENTS = ["The baker opened his last sack and shared it with every family.",
             "Machine learning models read text as tokens.", "bread"]


def _transformers_logits(path, pairs) -> torch.Tensor:
    """A classifier's logits of each input (a text, or a pair as its tokenizer joins it)
    alone, token types and all."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path)
    takes = inspect.signature(model.forward).parameters  # (MPNet's has no token types)
    with torch.no_grad():
        return torch.cat([model(**{k: v for k, v in tokenizer(
            *(x if isinstance(x, tuple) else (x,)), return_tensors="pt").items()
            if k in takes}).logits for x in pairs])


@pytest.mark.parametrize("name", ["bert_cross", "xlmr_cross", "mpnet_cross", "modernbert_cross"])
def test_a_cross_encoder_scores_pairs_as_transformers(name, tiny_encoder_classifiers):
    path = tiny_encoder_classifiers[name]
    with LLM(str(path), **FLAGS) as llm:
        assert llm.config.pooler_config.task == "classify"
        assert llm.config.pooler_config.pooling_type == "CLS"
        scores = [o.outputs.score for o in llm.score(QUERY, DOCUMENTS, use_tqdm=False)]
    want = _transformers_logits(path, [(QUERY, d) for d in DOCUMENTS]).sigmoid()[:, 0]
    torch.testing.assert_close(torch.tensor(scores), want, atol=2e-6, rtol=1e-5)
    assert want.max() - want.min() > 0.01  # (the documents are told apart)


@pytest.mark.parametrize("name", ["bert_labels", "distilbert_labels"])
def test_a_classifier_of_several_labels_as_transformers(name, tiny_encoder_classifiers):
    path = tiny_encoder_classifiers[name]
    with LLM(str(path), **FLAGS) as llm:
        probs = torch.tensor([o.outputs.probs for o in llm.classify(PROMPTS, use_tqdm=False)])
    want = _transformers_logits(path, PROMPTS).softmax(-1)
    torch.testing.assert_close(probs, want, atol=2e-6, rtol=1e-5)
