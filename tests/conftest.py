import os

# Nothing is fetched from a model hub in tests; Triton kernels run on the CPU interpreter.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from checkpoints import *  # noqa: E402,F401,F403  (session fixtures: tiny checkpoints, SmolLM2)
from lora_adapters import tiny_llama_adapters  # noqa: E402,F401  (session fixture)
from embedding_models import tiny_classifier_dirs, tiny_embedding_dirs  # noqa: E402,F401
from encoder_models import tiny_encoder_classifiers, tiny_encoder_dirs  # noqa: E402,F401
