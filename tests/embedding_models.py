"""Session fixtures: tiny sentence-transformers models over the tiny decoders, the oracle of the
embedding tests, and tiny classifiers (transformers' ``...ForSequenceClassification``). sentence-transformers writes each directory itself (``modules.json``, the
pooling module's config, the bare decoder's checkpoint: ``Qwen3Model``, no LM head), as the
embedding models users bring are laid out."""

from __future__ import annotations

import json

import pytest
import torch

__all__ = ["tiny_embedding_dirs", "tiny_classifier_dirs"]

# name -> (the decoder fixture, sentence-transformers' pooling mode, a Normalize module)
EMBEDDING_MODELS = {"qwen3_last": ("tiny_qwen3_dir", "lasttoken", True),
                    "llama_mean": ("tiny_llama_dir", "mean", True),
                    "qwen3_cls": ("tiny_qwen3_dir", "cls", True),
                    "qwen3_last_raw": ("tiny_qwen3_dir", "lasttoken", False)}


@pytest.fixture(scope="session")
def tiny_embedding_dirs(request, tmp_path_factory) -> dict:
    """name (``EMBEDDING_MODELS``) -> the directory. ``qwen3_last_raw`` leaves the vectors
    unnormalized and says it is trained for Matryoshka dimensions (``is_matryoshka``)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    dirs = {}
    for name, (decoder, mode, normalize) in EMBEDDING_MODELS.items():
        transformer = Transformer(str(request.getfixturevalue(decoder)))
        modules = [transformer, Pooling(transformer.get_embedding_dimension(), mode)]
        path = tmp_path_factory.mktemp(f"embed_{name}")
        SentenceTransformer(modules=modules + [Normalize()] * normalize, device="cpu").save(
            str(path))
        # text embeds as it is: given a tokenizer with a chat template, sentence-transformers 6
        # declares a "message" modality and renders every text through the template, which
        # vLLM's embed does not (nor did sentence-transformers before 6)
        st_config = json.loads((path / "sentence_bert_config.json").read_text())
        st_config["modality_config"].pop("message", None)
        (path / "sentence_bert_config.json").write_text(json.dumps(st_config))
        if name == "qwen3_last_raw":
            config = json.loads((path / "config.json").read_text())
            (path / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))
        dirs[name] = path
    return dirs


@pytest.fixture(scope="session")
def tiny_classifier_dirs(tiny_tokenizer_dir, tmp_path_factory) -> dict:
    """name -> a tiny ``...ForSequenceClassification`` checkpoint saved by transformers:
    ``qwen3_labels`` (three labels, named), ``llama_cross`` (one label: a cross-encoder)."""
    from checkpoints import _common
    from transformers import (AutoModelForSequenceClassification, AutoTokenizer, LlamaConfig,
                              Qwen3Config)

    configs = {"qwen3_labels": Qwen3Config(**_common(tiny_tokenizer_dir), num_labels=3,
                                           id2label={0: "sad", 1: "calm", 2: "glad"},
                                           label2id={"sad": 0, "calm": 1, "glad": 2}),
               "llama_cross": LlamaConfig(**_common(tiny_tokenizer_dir), num_labels=1,
                                          tie_word_embeddings=True)}
    dirs = {}
    for seed, (name, config) in enumerate(configs.items()):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(10 + seed)
            model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
        path = tmp_path_factory.mktemp(f"classify_{name}")
        model.save_pretrained(path)
        AutoTokenizer.from_pretrained(tiny_tokenizer_dir).save_pretrained(path)
        dirs[name] = path
    return dirs
