"""SmolLM2-135M-Instruct (the shipped GGUF, dequantized) as a sentence-transformers model with
last-token pooling and normalization: the embedding benchmark's model."""
import json, pathlib, sys
from actorlm.models.gguf_file import write_dense_copy
from actorlm.models.loader import default_gguf_path
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

dense, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
dense.mkdir(parents=True, exist_ok=True)
write_dense_copy(default_gguf_path(), dense)
t = Transformer(str(dense))
SentenceTransformer(modules=[t, Pooling(t.get_embedding_dimension(), "lasttoken"), Normalize()],
                    device="cpu").save(str(out))
config = json.loads((out / "sentence_bert_config.json").read_text())
config["modality_config"].pop("message", None)  # plain text, not the chat template
(out / "sentence_bert_config.json").write_text(json.dumps(config))
