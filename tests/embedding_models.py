"""Session fixture: tiny sentence-transformers models over the tiny decoders, the oracle of the
embedding tests. sentence-transformers writes each directory itself (``modules.json``, the
pooling module's config, the bare decoder's checkpoint: ``Qwen3Model``, no LM head), as the
embedding models users bring are laid out."""

from __future__ import annotations

import json

import pytest

__all__ = ["tiny_embedding_dirs"]

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
