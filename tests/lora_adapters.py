"""Tiny random PEFT LoRA adapters (B non-zero: PEFT's default init would make every delta
zero), built once per session for the tiny checkpoints."""

from __future__ import annotations

import pytest
import torch

__all__ = ["ALL_TARGETS", "make_adapter", "tiny_llama_adapters"]

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(model_dir, path, seed, **config):
    """A random adapter of the model at ``model_dir`` saved at ``path``; returns PEFT's model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = {"r": 4, "lora_alpha": 8, "target_modules": ALL_TARGETS, **config}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = get_peft_model(base, LoraConfig(init_lora_weights=False, **config))
        with torch.no_grad():  # deltas large enough to change the greedy tokens
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.mul_(4.0)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def tiny_llama_adapters(tiny_llama_dir, tmp_path_factory):
    """Three adapters of the tiny Llama: name -> directory (ranks 4, 8 with rsLoRA, and 16 on
    attention only)."""
    configs = {"alpha": dict(r=4), "beta": dict(r=8, use_rslora=True),
               "gamma": dict(r=16, lora_alpha=16, target_modules=ALL_TARGETS[:4])}
    adapters = {}
    for seed, (name, config) in enumerate(configs.items()):
        path = tmp_path_factory.mktemp(f"lora_{name}")
        make_adapter(tiny_llama_dir, path, seed=10 + seed, **config)
        adapters[name] = path
    return adapters
