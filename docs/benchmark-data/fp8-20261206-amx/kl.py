"""How far this engine's next-token distributions land from transformers' on SmolLM2 in FP8
(make_checkpoints.py), against how far transformers moves from itself when its embeddings are
perturbed by 1e-7 (relative) or it runs in bf16: mean KL over a 40-token prompt and 16 greedy
tokens. Run from the repository root."""
import sys
import torch
sys.path[:0] = ["tests", "tests/models"]
from quantized_oracle import logits_and_greedy, mean_kl, their_logits
from transformers import AutoModelForCausalLM
from actorlm.kernels import select_backend
from actorlm.models.loader import load_model

prompt = list(range(1000, 1040))
for name, oracle in [("channel", "channel"), ("method", "block")]:
    theirs = AutoModelForCausalLM.from_pretrained(f"/tmp/smol-fp8-{oracle}", dtype=torch.float32)
    for dtype in (torch.float32, torch.bfloat16):
        ours = load_model(f"/tmp/smol-fp8-{name}", dtype, "cpu", select_backend("cpu"))
        logits, tokens, _ = logits_and_greedy(ours, prompt, 16)
        ids = prompt + tokens[:-1]
        reference = their_logits(theirs, ids)
        print(f"fp8-{name} {str(dtype)[6:]}: ours against transformers fp32 "
              f"{mean_kl(reference, logits):.4f}")
    noise = torch.Generator().manual_seed(0)
    hook = theirs.model.embed_tokens.register_forward_hook(
        lambda m, a, out: out * (1 + 1e-7 * torch.randn(out.shape, generator=noise)))
    print(f"fp8-{name}: transformers perturbed by 1e-7 {mean_kl(reference, their_logits(theirs, ids)):.4f}")
    hook.remove()
    bf16 = AutoModelForCausalLM.from_pretrained(f"/tmp/smol-fp8-{oracle}", dtype=torch.bfloat16)
    print(f"fp8-{name}: transformers bf16 {mean_kl(reference, their_logits(bf16, ids)):.4f}")
    dense = AutoModelForCausalLM.from_pretrained("/tmp/smollm2-dense", dtype=torch.float32)
    print(f"fp8-{name}: the dense weights (transformers) against FP8 "
          f"{mean_kl(their_logits(dense, ids), reference):.4f}")
