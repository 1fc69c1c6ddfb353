"""Session fixtures: tiny encoder models (BERT, XLM-RoBERTa) as users bring them: embedding
models, and classifiers (cross-encoders).

transformers draws the random encoder and saves it; sentence-transformers writes each
directory (``modules.json``, its pooling module, ``BertModel``'s checkpoint), the layout of
all-MiniLM, BGE and E5. The BERT ones carry a WordPiece tokenizer ([CLS] ... [SEP]), the
XLM-RoBERTa one a tokenizer that wraps each text in <s> ... </s>, as theirs do. The classifiers
are transformers' ``...ForSequenceClassification`` as a cross-encoder's checkpoint holds them.
"""

from __future__ import annotations

import json

import pytest
import torch

__all__ = ["tiny_encoder_dirs", "tiny_encoder_classifiers", "ENCODER_MODELS",
           "ENCODER_CLASSIFIERS"]

# name -> (the encoder, sentence-transformers' pooling mode, or None: transformers' files
# alone, no sentence-transformers modules)
ENCODER_MODELS = {"bert_cls": ("bert", "cls"), "bert_mean": ("bert", "mean"),
                  "xlmr_mean": ("xlm-roberta", "mean"), "bert_bare": ("bert", None),
                  "mpnet_mean": ("mpnet", "mean"), "distilbert_cls": ("distilbert", "cls"),
                  "modernbert_cls": ("modernbert", "cls"), "bert_dense": ("bert", "mean"),
                  "embeddinggemma": ("embeddinggemma", "mean")}
# name -> its sentence-transformers Dense modules after the pooling: (in, out, activation)
_PROJECTIONS = {"bert_dense": [(64, 32, "Tanh")],  # (LaBSE's kind)
                "embeddinggemma": [(64, 128, "Identity"), (128, 64, "Identity")]}
# name -> (the encoder, its labels): cross-encoders (one label) and a classifier of three
ENCODER_CLASSIFIERS = {"bert_cross": ("bert", 1), "xlmr_cross": ("xlm-roberta", 1),
                       "bert_labels": ("bert", 3), "mpnet_cross": ("mpnet", 1),
                       "distilbert_labels": ("distilbert", 2), "modernbert_cross": ("modernbert", 1)}


@pytest.fixture(scope="session")
def tiny_encoder_dirs(tmp_path_factory, tiny_tokenizer_dir) -> dict:
    """name (``ENCODER_MODELS``) -> the directory; each vector normalized (a Normalize
    module), the bare one as transformers saves a ``BertModel``, and those of
    ``_PROJECTIONS`` with Dense modules between their pooling and normalizing.
    ``embeddinggemma`` is EmbeddingGemma's layout: a Gemma 3 decoder attending both ways
    (its local layers within a window), mean pooling, two projections."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import (Dense, Normalize, Pooling,
                                                                    Transformer)

    tokenizers = _tokenizers(tmp_path_factory, tiny_tokenizer_dir)
    encoders = {kind: _encoder(kind, tokenizers[kind], tmp_path_factory, seed)
                for seed, kind in enumerate(tokenizers)}
    dirs = {}
    for name, (kind, mode) in ENCODER_MODELS.items():
        if mode is None:
            dirs[name] = encoders[kind]
            continue
        transformer = Transformer(str(encoders[kind]))
        modules = [transformer, Pooling(transformer.get_embedding_dimension(), mode)]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(50)
            modules += [Dense(n_in, n_out, activation_function=getattr(torch.nn, act)())
                        for n_in, n_out, act in _PROJECTIONS.get(name, ())]
        modules.append(Normalize())
        path = tmp_path_factory.mktemp(f"encoder_{name}")
        SentenceTransformer(modules=modules, device="cpu").save(str(path))
        # text embeds as it is (the tiny BPE has a chat template, through which
        # sentence-transformers 6 would render it: ``embedding_models.py`` says why not)
        st_config = json.loads((path / "sentence_bert_config.json").read_text())
        st_config.get("modality_config", {}).pop("message", None)
        (path / "sentence_bert_config.json").write_text(json.dumps(st_config))
        dirs[name] = path
    return dirs


@pytest.fixture(scope="session")
def tiny_encoder_classifiers(tmp_path_factory, tiny_tokenizer_dir) -> dict:
    """name (``ENCODER_CLASSIFIERS``) -> the directory of a ``...ForSequenceClassification``."""
    tokenizers = _tokenizers(tmp_path_factory, tiny_tokenizer_dir)
    return {name: _encoder(kind, tokenizers[kind], tmp_path_factory, 40 + seed, labels)
            for seed, (name, (kind, labels)) in enumerate(ENCODER_CLASSIFIERS.items())}


def _tokenizers(tmp_path_factory, tiny_tokenizer_dir) -> dict:
    wordpiece = _wordpiece(tmp_path_factory)
    return {"bert": wordpiece, "xlm-roberta": _wrapping_bpe(tiny_tokenizer_dir, tmp_path_factory),
            "mpnet": _mpnet_wordpiece(wordpiece, tmp_path_factory), "distilbert": wordpiece,
            "modernbert": wordpiece, "embeddinggemma": tiny_tokenizer_dir}


def _encoder(kind: str, tokenizer_dir, tmp_path_factory, seed: int, labels: int = 0):
    """A random ``BertModel`` / ``XLMRobertaModel`` (2 layers, hidden 64, 4 heads) with its
    biases and norms drawn too, saved with the tokenizer; with ``labels``, its
    ``...ForSequenceClassification`` of that many."""
    from checkpoints import perturbed
    from transformers import (AutoModel, AutoModelForSequenceClassification, AutoTokenizer,
                              BertConfig, DistilBertConfig, Gemma3TextConfig,
                              ModernBertConfig, MPNetConfig, XLMRobertaConfig)

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    sizes = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, initializer_range=0.3,
                 pad_token_id=tokenizer.pad_token_id)
    config = BertConfig(**sizes, max_position_embeddings=64, type_vocab_size=2) \
        if kind == "bert" else \
        DistilBertConfig(vocab_size=sizes["vocab_size"], dim=64, hidden_dim=128, n_layers=2,
                         n_heads=4, initializer_range=0.3, max_position_embeddings=64,
                         pad_token_id=sizes["pad_token_id"]) if kind == "distilbert" else \
        ModernBertConfig(**sizes, max_position_embeddings=64,
                         local_attention=8, cls_token_id=tokenizer.cls_token_id,
                         sep_token_id=tokenizer.sep_token_id, bos_token_id=tokenizer.cls_token_id,
                         eos_token_id=tokenizer.sep_token_id) if kind == "modernbert" else \
        Gemma3TextConfig(**sizes, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                         use_bidirectional_attention=True, sliding_window=8,
                         layer_types=["sliding_attention", "full_attention"],
                         max_position_embeddings=64, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id) if kind == "embeddinggemma" else \
        MPNetConfig(**sizes, max_position_embeddings=66) if kind == "mpnet" else \
        XLMRobertaConfig(**sizes, max_position_embeddings=66, type_vocab_size=1,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(30 + seed)
        if labels:
            config.num_labels = labels
        auto = AutoModelForSequenceClassification if labels else AutoModel
        model = perturbed(auto.from_config(config, dtype=torch.float32))
    path = tmp_path_factory.mktemp(f"tiny_{kind}_{labels}")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _wordpiece(tmp_path_factory):
    """BERT's uncased WordPiece over the tiny corpus, [CLS] text [SEP]."""
    from checkpoints import _CORPUS
    from tokenizers import BertWordPieceTokenizer
    from transformers import BertTokenizerFast

    trained = BertWordPieceTokenizer(lowercase=True)
    trained.train_from_iterator(_CORPUS.splitlines(), vocab_size=300)
    path = tmp_path_factory.mktemp("tiny_wordpiece")
    trained.save_model(str(path))
    BertTokenizerFast(vocab=str(path / "vocab.txt")).save_pretrained(path)
    return path


def _mpnet_wordpiece(wordpiece_dir, tmp_path_factory):
    """The WordPiece vocabulary as MPNet's holds it: <s> <pad> </s> <unk> first (its
    embeddings take row 1 for padding whatever the config says), each text <s> ... </s>."""
    from transformers import BertTokenizerFast

    words = [w for w in (wordpiece_dir / "vocab.txt").read_text().split("\n")
             if w and not w.startswith("[")]
    path = tmp_path_factory.mktemp("tiny_mpnet_wordpiece")
    (path / "vocab.txt").write_text("\n".join(["<s>", "<pad>", "</s>", "<unk>", "<mask>", *words]))
    tokenizer = BertTokenizerFast(vocab=str(path / "vocab.txt"), cls_token="<s>",
                                  sep_token="</s>", pad_token="<pad>", unk_token="<unk>",
                                  mask_token="<mask>")
    tokenizer.save_pretrained(path)
    return path


def _wrapping_bpe(tiny_tokenizer_dir, tmp_path_factory):
    """The tiny byte-level BPE, each text wrapped in <s> ... </s> (XLM-RoBERTa's way)."""
    from tokenizers import processors
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    inner = tokenizer.backend_tokenizer
    inner.post_processor = processors.RobertaProcessing(
        ("</s>", tokenizer.convert_tokens_to_ids("</s>")),
        ("<s>", tokenizer.convert_tokens_to_ids("<s>")), add_prefix_space=False)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=inner, bos_token="<s>", eos_token="</s>",
                                      pad_token="<pad>", cls_token="<s>", sep_token="</s>")
    path = tmp_path_factory.mktemp("tiny_wrapping_bpe")
    wrapped.save_pretrained(path)
    return path
