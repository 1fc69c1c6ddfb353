"""A BERT-base-sized embedding model (12 layers, hidden 768, 12 heads, MLP 3072: all-mpnet's and
bge-base's sizes) with random weights, laid out by sentence-transformers as e5-base and
all-MiniLM are (mean pooling, Normalize). Its WordPiece vocabulary is trained on the bench's
own texts' words and characters (no hub here): the speed depends on the shapes, not on the
weights.

usage: python make_bert.py OUT_DIR
"""

import pathlib
import sys
import tempfile

import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
from transformers import BertConfig, BertModel, BertTokenizerFast

from actorlm.bench.throughput import bench_prompts

out = sys.argv[1]
text = " ".join(c[0]["content"] for c in bench_prompts(64)).lower()
words = sorted(set(text.replace(".", " . ").replace(",", " , ").split()))
chars = sorted(set(text) - {" "})
vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, *("##" + c for c in chars), *words]
with tempfile.TemporaryDirectory() as tmp:
    pathlib.Path(f"{tmp}/vocab.txt").write_text("\n".join(dict.fromkeys(vocab)) + "\n")
    tokenizer = BertTokenizerFast(vocab=f"{tmp}/vocab.txt")
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=768, num_hidden_layers=12,
                        num_attention_heads=12, intermediate_size=3072)
    torch.manual_seed(0)
    BertModel(config).save_pretrained(f"{tmp}/bert")
    tokenizer.save_pretrained(f"{tmp}/bert")
    transformer = Transformer(f"{tmp}/bert")
    modules = [transformer, Pooling(transformer.get_embedding_dimension(), "mean"), Normalize()]
    SentenceTransformer(modules=modules, device="cpu").save(out)
print(out)
