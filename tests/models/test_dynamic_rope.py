"""Dynamic NTK RoPE scaling (``rope_type: dynamic``): within the model's original context,
where transformers turns every position by the unscaled base, the same logits and greedy
tokens as transformers; a longer context, where its base would grow with each sequence, is
refused naming why."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from greedy import check_logprobs_close, hf_continuation
from paged_contexts import greedy_with_logits, random_prompt

from actorlm.config import EngineConfig
from actorlm.kernels import select_backend
from actorlm.models.loader import load_hf_config, load_model

DYNAMIC = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}


@pytest.fixture(scope="module")
def dynamic_dir(tiny_llama_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("dynamic") / "tiny_llama_dynamic"
    shutil.copytree(tiny_llama_dir, path)
    config = json.loads((path / "config.json").read_text())
    config.pop("rope_scaling", None)
    (path / "config.json").write_text(json.dumps({**config, "rope_parameters": DYNAMIC}))
    return path


def test_within_its_context_it_computes_what_transformers_does(dynamic_dir):
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(dynamic_dir, dtype=torch.float32).eval()
    assert theirs.config.rope_parameters["rope_type"] == "dynamic"
    ours = load_model(dynamic_dir, torch.float32, "cpu", select_backend("cpu"))
    prompt = random_prompt(ours.vocab_size, 200)
    logits, tokens, tops = greedy_with_logits(ours, prompt, 40, block_size=16)
    check_logprobs_close([(tokens, tops)], [hf_continuation(theirs, prompt, 40)])
    with torch.inference_mode():
        expected = theirs(torch.tensor([prompt + tokens[:-1]])).logits[0]
    torch.testing.assert_close(logits, expected, atol=2e-4, rtol=0)


def test_a_longer_context_is_refused_naming_why(dynamic_dir):
    config = load_hf_config(dynamic_dir)
    assert EngineConfig().resolve_lengths(config).max_model_len == 512
    with pytest.raises(ValueError, match=r"--max-model-len 1024 exceeds the model's original "
                                         r"context \(512 positions\): beyond it dynamic NTK"):
        EngineConfig(max_model_len=1024).resolve_lengths(config)
