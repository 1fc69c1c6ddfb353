"""Random-weight checkpoints of SmolLM2-135M's shape in four families (bf16), with SmolLM2's
tokenizer: the decode step's cost per family, not their text."""
import pathlib, shutil, sys, torch
from transformers import (AutoModelForCausalLM, CohereConfig, LlamaConfig, PhiConfig,
                          Starcoder2Config)
tok = pathlib.Path.home() / ".cache/actorlm/SmolLM2-135M-Instruct.Q4_1-98362432-gguf"
out = pathlib.Path(sys.argv[1])
shape = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
             num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048)
configs = {"llama": LlamaConfig(**shape, tie_word_embeddings=True),
           "phi": PhiConfig(**shape, tie_word_embeddings=False),
           "starcoder2": Starcoder2Config(**shape, tie_word_embeddings=True),
           "cohere": CohereConfig(**shape, tie_word_embeddings=True)}
for name, config in configs.items():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out / name)
    for f in tok.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / name / f.name)
    print(name, sum(p.numel() for p in model.parameters()) / 1e6, "M")
