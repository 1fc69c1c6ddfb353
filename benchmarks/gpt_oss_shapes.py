"""GPT-OSS at gpt-oss-20b's shapes, a few layers deep, against vLLM's CPU build.

    python benchmarks/gpt_oss_shapes.py [--layers 4] [--dir /tmp/actorlm-gpt-oss-shapes]
        [--vllm-python /path/to/vllm/venv/bin/python] [--rounds 3]

The release cannot be fetched here, so the script writes, once, a random checkpoint as OpenAI
stores gpt-oss-20b (hidden 2,880, 64 query and 8 KV heads of 64, 32 experts of 2,880 features,
top 4, sliding layers of 128 between full ones, YaRN, a vocabulary of 201,088): its experts in
MXFP4 blocks (random nibbles, E8M0 scales of 2^-8), the rest in bf16 (normal, sd 0.02), only
``--layers`` of its 24 layers deep; SmolLM2's tokenizer (the prompts are random token ids).
Then, taking turns ``--rounds`` times: ``actorlm bench latency`` on one stream and on 16 at
once (128 random prompt tokens, 64 output tokens, bf16), and, with ``--vllm-python``, the same
two measurements by vLLM's ``LLM`` on the same checkpoint (``gpt_oss_vllm_peer.py``, run by
that interpreter): one stream's time per output token, and 16 streams' output tokens a second
over the whole run. One JSON line per measurement, then the medians.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys

HIDDEN, EXPERT_WIDTH, EXPERTS, TOP_K = 2880, 2880, 32, 4
HEADS, KV_HEADS, HEAD_DIM, VOCAB, WINDOW = 64, 8, 64, 201088, 128
SCALE = 119  # E8M0: 2^-8, so the FP4 values (up to 6) make weights of at most 0.023
PEER = pathlib.Path(__file__).with_name("gpt_oss_vllm_peer.py")
BATCH, INPUT_LEN, OUTPUT_LEN = 16, 128, 64  # (the peer's shapes too)


def config(layers: int) -> dict:
    return {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
        "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": EXPERT_WIDTH,
        "num_hidden_layers": layers, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "num_local_experts": EXPERTS,
        "num_experts_per_tok": TOP_K, "experts_per_token": TOP_K, "sliding_window": WINDOW,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                        for i in range(layers)],
        "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                            "original_max_position_embeddings": 4096},
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096},
        "rope_theta": 150000.0, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "attention_bias": True, "swiglu_limit": 7.0, "tie_word_embeddings": False,
        "hidden_act": "silu", "initial_context_length": 4096, "dtype": "bfloat16",
        "torch_dtype": "bfloat16", "eos_token_id": 2, "pad_token_id": 0, "bos_token_id": 1,
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head"]},
    }


def build(path: pathlib.Path, layers: int) -> None:
    """The random checkpoint, once (a few GB: one file per layer)."""
    if (path / "config.json").is_file():
        return
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from actorlm.models.loader import resolve_model

    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)

    def normal(*shape, sd=0.02):
        return (torch.randn(*shape, generator=gen) * sd).to(torch.bfloat16)

    def mxfp4(rows, columns):
        blocks = torch.randint(0, 256, (EXPERTS, rows, columns // 32, 16), generator=gen,
                               dtype=torch.uint8)
        return blocks, torch.full((EXPERTS, rows, columns // 32), SCALE, dtype=torch.uint8)

    index = {}
    top = {"model.embed_tokens.weight": normal(VOCAB, HIDDEN), "lm_head.weight":
           normal(VOCAB, HIDDEN), "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16)}
    save_file(top, path / "top.safetensors", metadata={"format": "pt"})
    index.update(dict.fromkeys(top, "top.safetensors"))
    for layer in range(layers):
        p = f"model.layers.{layer}."
        q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
        tensors = {
            f"{p}input_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
            f"{p}post_attention_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
            f"{p}self_attn.sinks": normal(HEADS, sd=1.0),
            f"{p}mlp.experts.gate_up_proj_bias": normal(EXPERTS, 2 * EXPERT_WIDTH),
            f"{p}mlp.experts.down_proj_bias": normal(EXPERTS, HIDDEN),
        }
        for name, (rows, columns) in (("self_attn.q_proj", (q, HIDDEN)),
                                      ("self_attn.k_proj", (kv, HIDDEN)),
                                      ("self_attn.v_proj", (kv, HIDDEN)),
                                      ("self_attn.o_proj", (HIDDEN, q)),
                                      ("mlp.router", (EXPERTS, HIDDEN))):
            tensors[f"{p}{name}.weight"] = normal(rows, columns)
            tensors[f"{p}{name}.bias"] = normal(rows)
        for name, (rows, columns) in (("gate_up_proj", (2 * EXPERT_WIDTH, HIDDEN)),
                                      ("down_proj", (HIDDEN, EXPERT_WIDTH))):
            blocks, scales = mxfp4(rows, columns)
            tensors[f"{p}mlp.experts.{name}_blocks"] = blocks
            tensors[f"{p}mlp.experts.{name}_scales"] = scales
        file = f"layer-{layer}.safetensors"
        save_file(tensors, path / file, metadata={"format": "pt"})
        index.update(dict.fromkeys(tensors, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    (path / "config.json").write_text(json.dumps(config(layers), indent=1))
    AutoTokenizer.from_pretrained(resolve_model(None)).save_pretrained(path)


def ours(path: pathlib.Path, kind: str) -> dict:
    """``actorlm bench latency`` in its own process: one stream, or (``throughput``) 16 at
    once, whose output tokens a second over the whole run are vLLM's figure."""
    batch = 1 if kind == "latency" else BATCH
    done = subprocess.run([sys.executable, "-m", "actorlm.api.cli", "bench", "latency",
                           "--model", str(path), "--dtype", "bfloat16", "--max-model-len",
                           "1024", "--json", "--batch-size", str(batch), "--input-len",
                           str(INPUT_LEN), "--output-len", str(OUTPUT_LEN)],
                          capture_output=True, text=True, check=True)
    result = last_json(done.stdout)
    if kind == "throughput":
        result["output_tokens_per_s"] = round(BATCH * OUTPUT_LEN / result["e2e_s"], 2)
    return result


def peer(python: str, path: pathlib.Path, kind: str) -> dict:
    done = subprocess.run([python, str(PEER), str(path), kind], capture_output=True, text=True,
                          check=True)
    return last_json(done.stdout)


def last_json(stdout: str) -> dict:
    """The last JSON object a run printed (vLLM logs to stdout too)."""
    return json.loads(next(line for line in reversed(stdout.splitlines())
                           if line.startswith("{")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dir", type=pathlib.Path,
                        default=pathlib.Path("/tmp/actorlm-gpt-oss-shapes"))
    parser.add_argument("--vllm-python")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    path = args.dir / f"gpt-oss-20b-shapes-{args.layers}-layers"
    build(path, args.layers)
    results = {}
    for _ in range(args.rounds):  # taking turns: a noisy machine slows both alike
        for kind in ("latency", "throughput"):
            for name in ("actorlm", "vllm") if args.vllm_python else ("actorlm",):
                result = ours(path, kind) if name == "actorlm" else \
                    peer(args.vllm_python, path, kind)
                print(json.dumps({"engine": name, "kind": kind, **result}), flush=True)
                results.setdefault((name, kind), []).append(result)
    for (name, kind), runs in results.items():
        key = "tpot_ms" if kind == "latency" else "output_tokens_per_s"
        print(f"{name} {kind}: {key} median {statistics.median(r[key] for r in runs):.2f} "
              f"({[round(r[key], 2) for r in runs]})")


if __name__ == "__main__":
    main()
