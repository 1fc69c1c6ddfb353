"""Model resolution: directories, GGUF files, the cached default model, and clear errors."""

from __future__ import annotations

import json
import pathlib
import re
import shutil

import pytest
import torch

from actorlm.kernels import select_backend
from actorlm.models import gguf_file, loader
from actorlm.models.loader import load_hf_config, load_model, resolve_model


def test_unknown_path_names_it(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ValueError, match="no-such-model"):
        resolve_model(str(missing))


def test_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(tmp_path)


def test_unsupported_model_type_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bloom"}))
    with pytest.raises(ValueError, match="bloom"):
        resolve_model(tmp_path)


def test_directory_is_used_as_is(tiny_qwen2_dir):
    assert resolve_model(str(tiny_qwen2_dir)) == tiny_qwen2_dir
    assert load_hf_config(tiny_qwen2_dir).model_type == "qwen2"


def test_load_model_reports_missing_weights(tiny_llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama_dir, broken)
    state = load_file(broken / "model.safetensors")
    del state["model.layers.1.self_attn.k_proj.weight"]
    save_file(state, broken / "model.safetensors")
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.qkv_proj"):
        load_model(broken, torch.float32, "cpu", select_backend("cpu"))


def test_sharded_checkpoint_loads_like_a_single_file(tiny_qwen3_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    sharded = tmp_path / "sharded"
    shutil.copytree(tiny_qwen3_dir, sharded)
    state = load_file(sharded / "model.safetensors")
    (sharded / "model.safetensors").unlink()
    names = sorted(state)
    save_file({n: state[n] for n in names[::2]}, sharded / "model-00001-of-00002.safetensors")
    save_file({n: state[n] for n in names[1::2]}, sharded / "model-00002-of-00002.safetensors")
    backend = select_backend("cpu")
    a = load_model(tiny_qwen3_dir, torch.float32, "cpu", backend).state_dict()
    b = load_model(sharded, torch.float32, "cpu", backend).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_default_model_is_read_once_into_a_cache_without_weights(smollm2_dir, monkeypatch):
    path = pathlib.Path(smollm2_dir)
    assert (path / "config.json").is_file()
    assert not list(path.glob("*.safetensors"))  # the weights stay in the GGUF file
    assert (path / "tokenizer.json").is_file() or (path / "tokenizer.model").is_file()
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"

    def read_again(*args):
        raise AssertionError("the cached metadata was read again")

    monkeypatch.setattr(gguf_file, "_write_dir", read_again)
    assert resolve_model(None) == path
    # The same GGUF file passed by path maps onto the same cache entry.
    assert resolve_model(str(loader.default_gguf_path())) == path


def test_cache_honours_xdg_cache_home(smollm2_dir, tmp_path, monkeypatch):
    # A cache entry already present under $XDG_CACHE_HOME/actorlm is used as it is.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    entry = tmp_path / "actorlm" / pathlib.Path(smollm2_dir).name
    shutil.copytree(smollm2_dir, entry)
    monkeypatch.setattr(gguf_file, "_write_dir", None)  # would fail if called
    assert resolve_model(None) == entry


def test_the_default_model_is_named_after_its_gguf_file(smollm2_dir):
    assert gguf_file.model_name(smollm2_dir) == "SmolLM2-135M-Instruct.Q4_1"


def test_a_mistral_snapshot_loads_its_indexed_shards_and_ignores_consolidated(tiny_window_dirs,
                                                                             tmp_path):
    from safetensors.torch import load_file, save_file

    snapshot = tmp_path / "mistral"
    shutil.copytree(tiny_window_dirs["mistral"], snapshot)
    state = load_file(snapshot / "model.safetensors")
    (snapshot / "model.safetensors").unlink()
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: state[n] for n in part}, snapshot / file)
    (snapshot / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}))
    # Mistral's own layout of the same weights, which no Hugging Face name matches
    save_file({f"layers.{i}.attention.wq.weight": torch.zeros(4, 4) for i in range(2)},
              snapshot / "consolidated.safetensors")
    backend = select_backend("cpu")
    a = load_model(tiny_window_dirs["mistral"], torch.float32, "cpu", backend).state_dict()
    b = load_model(snapshot, torch.float32, "cpu", backend).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    (snapshot / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match="names files that are not there.*00002"):
        load_model(snapshot, torch.float32, "cpu", backend)


@pytest.mark.parametrize("family, change, named", [
    ("phi3", {"partial_rotary_factor": 0.3125}, "RoPE on 5 of a head's 16 features"),
    ("phi3", {"partial_rotary_factor": 1.5}, "RoPE on 24 of a head's 16 features"),
    ("phi3", {"partial_rotary_factor": -0.5}, "RoPE on -8 of a head's 16 features"),
    # (Gemma 3 attending both ways embeds, EmbeddingGemma: tests/engine/test_encoders.py)
    ("gemma3", {"use_bidirectional_attention": True},
     "use_bidirectional_attention embeds (--runner pooling)"),
    ("mistral", {"use_bidirectional_attention": True},
     "mistral: use_bidirectional_attention is not implemented"),
    ("mistral", {"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ("mistral", {"hidden_act": "gelu"}, "activation 'gelu'"),
    ("gemma3", {"query_pre_attn_scalar": 0}, "query_pre_attn_scalar must be positive, got 0"),
    ("gemma2", {"attn_logit_softcapping": -50.0}, "attn_logit_softcapping must be positive"),
    ("granite", {"logits_scaling": 0}, "logits_scaling must be a finite number above 0, got 0"),
    ("granite", {"residual_multiplier": float("nan")}, "residual_multiplier must be a finite"),
    ("smollm3", {"no_rope_layers": [1, 0]}, "no_rope_layers has 2 entries for 4 layers"),
])
def test_a_config_field_that_changes_the_math_and_is_not_implemented_is_refused(
        tiny_window_dirs, tmp_path, family, change, named):
    changed = tmp_path / family
    shutil.copytree(tiny_window_dirs[family], changed)
    config = json.loads((changed / "config.json").read_text())
    if family == "phi3":  # as a Phi-3 or Phi-4 file has them: no rope_parameters yet
        config.pop("rope_parameters", None)
    (changed / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=re.escape(named)):
        load_model(changed, torch.float32, "cpu", select_backend("cpu"))
