"""A mixture-of-experts model against a dense one of the same active parameters, on one stream.

    python benchmarks/moe_vs_dense.py [--rounds 3] [--dir /tmp/actorlm-moe-vs-dense]

A decode row reads only its routed experts' weights, so a MoE model's time per output token
should stay near a dense model's whose MLP has top_k experts' width. The script builds, once,
random checkpoints where the weights dominate: Qwen3-MoE (hidden 1024, 16 experts, top 2,
expert width 1024, 8 layers, SmolLM2's vocabulary of 49,152) and a dense Qwen3 of its active parameters
(intermediate_size = top_k * expert width, all else the same); then ``actorlm bench latency
--dtype bfloat16 --json`` runs on each, taking turns ``--rounds`` times, and, last, once on
the MoE model with ``--compare hf``. It prints the medians, the ratio MoE / dense of the time
per output token, and both models' active and total parameters.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys

# the vocabulary is SmolLM2's, whose tokenizer the checkpoints take: a tokenizer smaller than
# the model's vocabulary would leave the random models' tokens without text
HIDDEN, LAYERS, VOCAB, HEADS, KV_HEADS, HEAD_DIM = 1024, 8, 49152, 16, 4, 64
EXPERTS, TOP_K, EXPERT_WIDTH = 16, 2, 1024


def configs():
    """(MoE config, dense config): the same dims, the dense MLP top_k experts wide."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                  max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0)
    moe = Qwen3MoeConfig(**common, intermediate_size=TOP_K * EXPERT_WIDTH, num_experts=EXPERTS,
                         num_experts_per_tok=TOP_K, moe_intermediate_size=EXPERT_WIDTH,
                         norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    dense = Qwen3Config(**common, intermediate_size=TOP_K * EXPERT_WIDTH)
    return moe, dense


def parameter_counts(config) -> tuple[int, int]:
    """(active, total) parameters: the routed experts a token does not take are not active."""
    attention = HIDDEN * HEAD_DIM * (2 * HEADS + 2 * KV_HEADS) + 2 * HEAD_DIM
    norms = 2 * HIDDEN
    if getattr(config, "num_experts", None):
        expert = 3 * HIDDEN * config.moe_intermediate_size
        active_mlp = config.num_experts_per_tok * expert + HIDDEN * config.num_experts
        total_mlp = config.num_experts * expert + HIDDEN * config.num_experts
    else:
        active_mlp = total_mlp = 3 * HIDDEN * config.intermediate_size
    rest = 2 * VOCAB * HIDDEN + HIDDEN  # embeddings, LM head, final norm
    layer = attention + norms
    return (rest + LAYERS * (layer + active_mlp), rest + LAYERS * (layer + total_mlp))


def build(path: pathlib.Path, config) -> None:
    """A random checkpoint of ``config`` with SmolLM2's tokenizer, once."""
    if (path / "config.json").is_file():
        return
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from actorlm.models.loader import resolve_model

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(resolve_model(None)).save_pretrained(path)


def bench(path: pathlib.Path, *extra: str) -> dict:
    """``actorlm bench latency`` on one stream, in its own process: its JSON line."""
    done = subprocess.run([sys.executable, "-m", "actorlm.api.cli", "bench", "latency",
                           "--model", str(path), "--dtype", "bfloat16", "--batch-size", "1",
                           "--json", *extra], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=pathlib.Path, default=pathlib.Path("/tmp/actorlm-moe-vs-dense-49k"))
    args = parser.parse_args()
    moe_config, dense_config = configs()
    paths = {"moe": args.dir / "qwen3-moe", "dense": args.dir / "qwen3-dense"}
    build(paths["moe"], moe_config)
    build(paths["dense"], dense_config)
    tpot = {"moe": [], "dense": []}
    for _ in range(args.rounds):  # taking turns: a noisy machine slows both alike
        for name, path in paths.items():
            tpot[name].append(bench(path)["tpot_ms"])
    hf = bench(paths["moe"], "--compare", "hf")
    for name, config in (("moe", moe_config), ("dense", dense_config)):
        active, total = parameter_counts(config)
        print(f"{name:5s}: tpot median {statistics.median(tpot[name]):.2f} ms "
              f"(runs {tpot[name]}); active {active / 1e6:.1f} M, total {total / 1e6:.1f} M "
              f"parameters")
    ratio = statistics.median(tpot["moe"]) / statistics.median(tpot["dense"])
    print(f"MoE / dense time per output token: {ratio:.2f}")
    print(f"MoE against transformers: tpot {hf['tpot_ms']} ms vs {hf['hf_tpot_ms']} ms "
          f"(transformers / actorlm {hf['decode_ratio_vs_hf']})")


if __name__ == "__main__":
    main()
