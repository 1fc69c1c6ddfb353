"""Random PEFT LoRA adapters of a model, for measuring LoRA where no trained adapter is at hand.

    python benchmarks/lora_adapters.py -o /tmp/smollm2-lora [--num 4] [--rank 16] [--model M]

PEFT builds each on the model's float weights (a GGUF file, the default model's included, is
dequantized into a Hugging Face directory first: ``gguf_file.write_dense_copy``), on q/k/v/o and
gate/up/down, with A and B both random (PEFT's default init zeroes B, which would make every
delta zero and let a kernel that skips the work look free). B is kept small, so the adapters
change the text without wrecking it. Writes ``<out>/lora-<i>`` for i = 1..num, the directories
``actorlm bench throughput --lora-path`` takes (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile

import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapters(model_dir: pathlib.Path, out: pathlib.Path, num: int, rank: int) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    for i in range(1, num + 1):
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        torch.manual_seed(1000 + i)
        model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank,
                                                target_modules=TARGETS,
                                                init_lora_weights=False))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.mul_(0.05)
        model.save_pretrained(out / f"lora-{i}")
        print(out / f"lora-{i}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-o", "--out", type=pathlib.Path, required=True)
    parser.add_argument("--num", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--model", type=pathlib.Path, default=None,
                        help="a Hugging Face directory or a GGUF file (default: SmolLM2's)")
    args = parser.parse_args()
    from actorlm.models.gguf_file import write_dense_copy
    from actorlm.models.loader import default_gguf_path

    model = args.model or default_gguf_path()
    if model.is_dir():
        write_adapters(model, args.out, args.num, args.rank)
        return
    with tempfile.TemporaryDirectory() as dense:
        write_dense_copy(model, pathlib.Path(dense))
        write_adapters(pathlib.Path(dense), args.out, args.num, args.rank)


if __name__ == "__main__":
    main()
