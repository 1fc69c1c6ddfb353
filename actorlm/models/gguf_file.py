"""A GGUF file as a model, read in place: its weights stay in the file's blocks.

The file is taken apart once into a small cached directory, ``$XDG_CACHE_HOME/actorlm/<name>``
(no weights in it): the transformers config, tokenizer and generation config rebuilt from the
file's metadata (a few seconds: the tokenizer conversion and the metadata parse are what is
slow), and ``gguf.json``, which names the file and lists its tensors (name, type, shape, byte
offset). Loading then memory-maps the file and hands each tensor over under its Hugging Face
name: the block formats this engine has kernels for as ``QuantizedWeight`` (the raw blocks,
one row per output feature), the float ones as tensors, MXFP4 (GPT-OSS's experts) as Q5_0
blocks of the same values (``mxfp4``), the others dequantized (logged once).

A mixture of experts' layers store their routed experts stacked, one 3-D tensor per projection
(``ffn_gate_exps``, ``ffn_up_exps`` [E, I, H], ``ffn_down_exps`` [E, H, I]); they are handed
over one expert at a time (``mlp.experts.{e}.gate_proj.weight`` …), each in its blocks as a
view of the file, which the layer that keeps it copies out (``moe.RoutedExperts``): a rank of
an expert-parallel model copies its own experts only. ``gguf_moe`` builds the configs of the
MoE files (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE).

llama.cpp stores a Llama's (and Mixtral's, SmolLM3's, Granite's) q and k rows permuted (each
head's two rotary halves interleaved); the permutation is undone here on whole rows of blocks,
which quantization never crosses. It stores a Gemma's norm weights plus one (what they scale by);
they are handed over as the checkpoint has them. ``gguf_metadata`` builds the config of the
files transformers does not read (SmolLM3, Granite, OLMo 2, GLM-4, Phi-2, Command R…) or reads
only in part (Phi-3, StarCoder2).
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import re
import shutil
import struct
import tempfile
from collections import Counter
from typing import Iterator, NamedTuple

import numpy as np
import torch

from actorlm.kernels import QUANTIZED_FORMATS, QuantizedWeight
from actorlm.kernels.resident import resident
from actorlm.models import gguf_metadata, gguf_moe, mxfp4, prequantized
from actorlm.paths import cache_root

log = logging.getLogger(__name__)

# GGUF architecture -> the Hugging Face model_type it is read as (Mistral files say "llama",
# and so do Mixtral's, with experts: gguf_moe tells them apart)
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma": "gemma",
                 "gemma2": "gemma2",
                 "gemma3": "gemma3_text", "smollm3": "smollm3", "granite": "granite",
                 "olmo2": "olmo2", "phi3": "phi3", "exaone4": "exaone4", "glm4": "glm4",
                 "ernie4_5": "ernie4_5", "seed_oss": "seed_oss", "starcoder2": "starcoder2",
                 "phi2": "phi", "command-r": "cohere", "cohere2": "cohere2",
                 "stablelm": "stablelm", "nemotron": "nemotron", "arcee": "arcee", "olmo": "olmo",
                 "gptneox": "gpt_neox", "falcon": "falcon", "gpt2": "gpt2",
                 "starcoder": "gpt_bigcode", "qwen2vl": "qwen2", "qwen3vl": "qwen3",
                 **gguf_moe.ARCHITECTURES}
# the architectures transformers cannot read a config of (gguf_metadata builds theirs)
_OWN_CONFIGS = {"smollm3": gguf_metadata.smollm3_config, "gemma": gguf_metadata.gemma_config,
                "granite": gguf_metadata.granite_config, "olmo2": gguf_metadata.olmo2_config,
                "phi3": gguf_metadata.phi3_config, "exaone4": gguf_metadata.exaone4_config,
                "glm4": gguf_metadata.glm4_config,
                "ernie4_5": gguf_metadata.ernie4_5_config,
                "seed_oss": gguf_metadata.seed_oss_config,
                # (transformers reads a StarCoder2 file's sizes but not its RoPE base)
                "starcoder2": gguf_metadata.starcoder2_config,
                "phi2": gguf_metadata.phi2_config, "command-r": gguf_metadata.command_r_config,
                "cohere2": gguf_metadata.cohere2_config,
                # (transformers reads a StableLM file, but not its rotated share or branches)
                "stablelm": gguf_metadata.stablelm_config,
                # (transformers reads a Nemotron file's epsilon and rotated share by other keys)
                "nemotron": gguf_metadata.nemotron_config, "arcee": gguf_metadata.arcee_config,
                "olmo": gguf_metadata.olmo_config, "gptneox": gguf_metadata.gptneox_config,
                "falcon": gguf_metadata.falcon_config, "gpt2": gguf_metadata.gpt2_config,
                "starcoder": gguf_metadata.starcoder_config,
                "qwen2vl": gguf_metadata.qwen2vl_config, "qwen3vl": gguf_metadata.qwen3vl_config}
_UNKNOWN_TO_TRANSFORMERS = ("smollm3", "gemma", "granite", "granitemoe", "olmo2", "olmoe",
                            "exaone4", "glm4", "ernie4_5", "seed_oss", "phi2", "command-r",
                            "cohere2", "arcee", "olmo", "gptneox", "falcon", "starcoder",
                            "qwen2vl", "qwen3vl", "glm4moe", "ernie4_5-moe", "gpt-oss")
# q and k rows permuted by llama.cpp's converter (a Llama's and its descendants')
_PERMUTED_QK = ("llama", "mistral", "mixtral", "smollm3", "granite", "granitemoe", "olmo")
# norms stored as 1 + weight (Gemma's; Nemotron's LayerNorm1P, whose loading adds the 1 back)
_ONE_PLUS_NORMS = ("gemma", "gemma2", "gemma3_text", "nemotron")
_FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_INDEX = "gguf.json"
_DIR_SUFFIX = "-gguf"  # of a cached directory: <file stem>-<file size>-gguf
_INDEX_VERSION = 5  # 4: end-of-turn tokens, Llama 3's rope_freqs; 5: pooling, key_length

# GGUF tensor name (after "blk.N.") -> the Hugging Face one (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", **gguf_moe.LAYER_NAMES,
}
# Gemma's four norms a layer (its "ffn_norm" is the one before the MLP, as a Llama's); OLMo 2's
# two after attention and MLP
_OUTPUT_NORM_NAMES = {**_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
                      "ffn_norm": "pre_feedforward_layernorm",
                      "post_ffw_norm": "post_feedforward_layernorm"}
# Seed-OSS's (and GLM-4.5's, GPT-OSS's) norm before the MLP, under the name Gemma's and OLMo 2's
# norm after attention has
_SEED_OSS_NAMES = {**_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm"}
# GLM-4's norms after attention and MLP beside a Llama's, and its gate/up fused (Phi-3's way)
_GLM4_NAMES = {**_LAYER_NAMES, "post_attention_norm": "post_self_attn_layernorm",
               "post_ffw_norm": "post_mlp_layernorm", "ffn_up": "mlp.gate_up_proj"}
# Phi-3's q/k/v and gate/up, fused as in its checkpoint (the model splits them)
_PHI3_LAYER_NAMES = {**_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj",
                     "ffn_up": "mlp.gate_up_proj"}
# StarCoder2's MLP without a gate; Phi-2's too, its attention's output and its last norm under
# names of their own, its q/k/v fused in the files converted from its first checkpoints
_STARCODER2_NAMES = {**_LAYER_NAMES, "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}
_PHI2_NAMES = {**_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.dense",
               "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"}
# GPT-NeoX's and Falcon's q/k/v fused as every head's q, then k, then v (the converters regroup
# them from the checkpoints' heads; GPT-2's and StarCoder's are so already) and their MLPs
# without a gate, under the decoder's own names; Falcon-40B's norm before the MLP
_GPTNEOX_NAMES = {**_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.fc_in"}
_FALCON_NAMES = {**_GPTNEOX_NAMES, "attn_norm_2": "post_attention_layernorm"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
              "output": "lm_head", "position_embd": "model.embed_positions"}
_PHI2_TOP_NAMES = {**_TOP_NAMES, "output_norm": "model.final_layernorm"}


class TensorInfo(NamedTuple):
    name: str  # the Hugging Face name
    type_name: str  # GGML's: Q4_1, F32...
    shape: tuple[int, ...]  # torch order: (out_features, in_features) for a matrix
    offset: int  # of its data in the file
    num_bytes: int


def model_name(path: pathlib.Path) -> str:
    """The name of the model in directory ``path``: a cached GGUF's is its file's stem."""
    return re.sub(rf"-\d+{_DIR_SUFFIX}$", "", pathlib.Path(path).name)


def is_gguf_dir(path: pathlib.Path) -> bool:
    """Whether ``path`` is the cached directory of a GGUF file (weights in the file)."""
    return (pathlib.Path(path) / _INDEX).is_file()


def architecture(gguf: pathlib.Path) -> str:
    """``general.architecture`` of the file, read from its header alone (milliseconds, where
    parsing all its metadata takes seconds)."""
    with open(gguf, "rb") as f:
        magic, version, _, num_kv = struct.unpack("<4sIQQ", f.read(24))
        if magic != b"GGUF" or version < 2:
            raise ValueError(f"{str(gguf)!r} is not a GGUF file of version 2 or later")
        for _ in range(num_kv):
            key = _read_string(f)
            (value_type,) = struct.unpack("<I", f.read(4))
            if key == "general.architecture" and value_type == _STRING:
                return _read_string(f)
            _skip_value(f, value_type)
    raise ValueError(f"{str(gguf)!r} has no general.architecture")


def check_architecture(gguf: pathlib.Path) -> None:
    arch = architecture(gguf)
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF file {str(gguf)!r} has architecture {arch!r}; supported: "
                         f"{', '.join(ARCHITECTURES)}")


def cached_dir(gguf: pathlib.Path) -> pathlib.Path:
    """The directory of ``gguf``'s config, tokenizer and tensor index, built on first use."""
    check_architecture(gguf)  # before anything slow
    # name + size: a different file with the same name gets its own entry
    target = cache_root() / f"{gguf.stem}-{gguf.stat().st_size}{_DIR_SUFFIX}"
    if _index_is_current(target, gguf):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("reading the metadata of %s into %s (once)", gguf, target)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _write_dir(gguf, tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is an ordinary directory
        shutil.rmtree(target, ignore_errors=True)  # an index of an older version
        try:
            os.replace(tmp, target)  # atomic: readers never see a half-written directory
        except OSError:
            if not _index_is_current(target, gguf):  # not just another process winning
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def tensor_infos(path: pathlib.Path) -> tuple[pathlib.Path, list[TensorInfo]]:
    """(the GGUF file, its tensors) of the cached directory ``path``."""
    index = json.loads((pathlib.Path(path) / _INDEX).read_text())
    return pathlib.Path(index["file"]), [TensorInfo(t[0], t[1], tuple(t[2]), t[3], t[4])
                                         for t in index["tensors"]]


def read_tensors(path: pathlib.Path, config, dtype: torch.dtype
                 ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Every tensor of the cached directory ``path``'s file under its Hugging Face name: the
    kept block formats as ``QuantizedWeight``, their blocks copied out of the memory-mapped
    file into huge pages (``kernels.resident``; a layer's stacked experts one expert at a time,
    left in the file for their layer to copy), float tensors as they are, other formats
    dequantized to ``dtype``."""
    file, infos = tensor_infos(path)
    # copy-on-write: torch wants a writable array; nothing writes, so the pages stay the file's
    data = np.memmap(file, dtype=np.uint8, mode="c")
    dequantized = Counter()
    for info in infos:
        raw = torch.from_numpy(data[info.offset:info.offset + info.num_bytes])  # no copy
        # (routed experts' blocks stay in the file: their layer copies its own share)
        tensor = _tensor(info, raw, config, dtype, dequantized,
                         copied=".mlp.experts." not in info.name)
        if gguf_moe.is_stacked_experts(info.name, info.shape):
            yield from gguf_moe.each_expert(info.name, tensor)
        else:
            yield info.name, tensor
    if dequantized:
        log.info("%s: dequantized at load to %s (no kernels for them): %s", file.name,
                 str(dtype).removeprefix("torch."),
                 ", ".join(f"{n} x {t}" for t, n in sorted(dequantized.items())))


def _tensor(info: TensorInfo, raw: torch.Tensor, config, dtype: torch.dtype,
            dequantized: Counter, copied: bool) -> torch.Tensor | QuantizedWeight:
    """One tensor of the file (``raw`` its bytes), as ``read_tensors`` hands it over; blocks
    ``copied`` into huge pages, or left a view of the file."""
    import gguf as gguf_package

    rows = int(np.prod(info.shape[:-1]))
    if info.type_name in QUANTIZED_FORMATS and len(info.shape) >= 2:
        blocks = _unpermuted(info.name, raw.view(rows, -1), config)
        return QuantizedWeight(info.type_name, resident(blocks) if copied else blocks,
                               info.shape)
    if info.type_name == "MXFP4":  # (GPT-OSS's experts) into Q5_0 blocks, exactly
        weight, kind = prequantized.as_weight(mxfp4.gguf_grouped(raw, rows), dtype, copied)
        if isinstance(weight, QuantizedWeight):
            return weight._replace(shape=info.shape)
        dequantized[f"MXFP4 ({kind})"] += 1
        return weight.view(info.shape)
    if info.type_name in _FLOAT_TYPES:
        values = raw.view(_FLOAT_TYPES[info.type_name]).view(info.shape)
        if config.model_type in _ONE_PLUS_NORMS and info.name.endswith("norm.weight"):
            values = values - 1
        return _unpermuted(info.name, values, config)
    kind = gguf_package.GGMLQuantizationType[info.type_name]
    values = torch.from_numpy(gguf_package.quants.dequantize(raw.numpy(), kind))
    dequantized[info.type_name] += 1
    return _unpermuted(info.name, values.view(info.shape).to(dtype), config)


def write_dense_copy(gguf: pathlib.Path, out: pathlib.Path) -> None:
    """The file dequantized by transformers into a Hugging Face directory ``out`` (fp32
    safetensors): the same weights as floats, for comparisons (benchmarks, the tests' oracle)."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    model = _transformers_gguf_model(gguf, torch.float32)
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    out.mkdir(parents=True, exist_ok=True)
    # save_pretrained refuses GGUF-quantized models, so the weights are written by hand
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                  local_files_only=True).save_pretrained(out)


def transformers_model(path: pathlib.Path, dtype: torch.dtype):
    """transformers' own model of the directory ``path``; of a cached GGUF's, the file as
    transformers reads it (dequantized to ``dtype``): the peer the benchmarks compare with."""
    from transformers import AutoModelForCausalLM

    if is_gguf_dir(path):
        return _transformers_gguf_model(tensor_infos(path)[0], dtype)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def _transformers_gguf_model(gguf: pathlib.Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype,
                                                local_files_only=True)


def _unpermuted(name: str, rows: torch.Tensor, config) -> torch.Tensor:
    """Rows of q_proj / k_proj back in Hugging Face's order (a Llama's, as llama.cpp permutes
    them); any other tensor as it is."""
    if config.model_type not in _PERMUTED_QK or \
            not name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
        return rows
    heads = config.num_attention_heads if "q_proj" in name else \
        getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    half = rows.shape[0] // heads // 2  # each head's rows: [half, 2] in the file, [2, half] here
    return rows.reshape(heads, half, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def _hf_name(name: str, arch: str) -> str:
    stem, _, kind = name.rpartition(".")  # kind: weight or bias
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        if f"{part}.{kind}" in gguf_moe.WHOLE_NAMES:
            return f"model.layers.{layer}.{gguf_moe.WHOLE_NAMES[f'{part}.{kind}']}"
        names = _OUTPUT_NORM_NAMES if arch in ("gemma2", "gemma3", "olmo2", "exaone4") else \
            {"phi3": _PHI3_LAYER_NAMES, "seed_oss": _SEED_OSS_NAMES, "glm4": _GLM4_NAMES,
             "glm4moe": _SEED_OSS_NAMES, "gpt-oss": _SEED_OSS_NAMES,
             "starcoder2": _STARCODER2_NAMES, "phi2": _PHI2_NAMES,
             "gptneox": _GPTNEOX_NAMES, "gpt2": _GPTNEOX_NAMES, "starcoder": _GPTNEOX_NAMES,
             "falcon": _FALCON_NAMES}.get(arch, _LAYER_NAMES)
        part = names.get(part) or gguf_moe.per_expert_name(part)
        if part is None:
            raise ValueError(f"GGUF tensor {name!r} is not one this engine knows")
        return f"model.layers.{layer}.{part}.{kind}"
    top_names = _PHI2_TOP_NAMES if arch == "phi2" else _TOP_NAMES
    if stem not in top_names:
        raise ValueError(f"GGUF tensor {name!r} is not one this engine knows")
    return f"{top_names[stem]}.{kind}"


def _in_draft_layers(name: str, first_draft: int | None) -> bool:
    """Whether ``name`` is a tensor of the file's multi-token-prediction layers."""
    return first_draft is not None and name.startswith("blk.") and \
        int(name.split(".")[1]) >= first_draft


def _write_dir(gguf: pathlib.Path, out: pathlib.Path) -> None:
    from gguf import GGUFReader
    from transformers import (AutoConfig, AutoTokenizer, GenerationConfig,
                              PreTrainedTokenizerFast)

    reader = GGUFReader(gguf)
    arch = architecture(gguf)
    drafts = gguf_moe.draft_layers_from(reader, arch)
    tensors = [[name, t.tensor_type.name,
                gguf_moe.torch_shape(name, [int(n) for n in reversed(t.shape)]),
                int(t.data_offset), int(t.n_bytes)]  # data_offset: from the file's start
               for t in reader.tensors if t.name not in gguf_metadata.CONFIG_TENSORS and
               not _in_draft_layers(t.name, drafts)
               for name in [_hf_name(t.name, arch)]]
    names = [t[0] for t in tensors]
    if gguf_moe.is_moe_file(reader, arch):
        config = gguf_moe.moe_config(gguf, reader, names)
    elif arch in _OWN_CONFIGS:
        config = _OWN_CONFIGS[arch](reader, names)
    else:
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                            local_files_only=True)
    # (AutoTokenizer asks AutoConfig first, which refuses the files whose config is built
    # here; the conversion is the same for every architecture)
    tokenizer = (PreTrainedTokenizerFast if arch in _UNKNOWN_TO_TRANSFORMERS else AutoTokenizer) \
        .from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    if config.model_type == "llama":  # the metadata has no such keys: the tensors tell
        config.update(gguf_metadata.biases(names))
    # (transformers leaves its default; Falcon's is derived from the sizes, not set)
    if getattr(config, "head_dim", None) is not None and \
            not isinstance(getattr(type(config), "head_dim", None), property):
        config.head_dim = gguf_metadata.head_dim(reader, arch)
    gguf_metadata.read_rope_freqs(reader, config)
    config.update(gguf_metadata.pooling_type(reader, arch))
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / _INDEX).write_text(json.dumps({
        "version": _INDEX_VERSION, "file": str(gguf.resolve()), **_identity(gguf),
        "tensors": tensors}))


def _index_is_current(target: pathlib.Path, gguf: pathlib.Path) -> bool:
    try:
        index = json.loads((target / _INDEX).read_text())
    except (OSError, ValueError):
        return False
    return index.get("version") == _INDEX_VERSION and \
        all(index.get(key) == value for key, value in _identity(gguf).items())


def _identity(gguf: pathlib.Path) -> dict:
    """What tells a file from another of its name: a rewritten file gets a fresh entry."""
    stat = gguf.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


# --- the header's key-value pairs (GGUF v2+: little-endian, 64-bit lengths) -------------------

_STRING, _ARRAY = 8, 9
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _read_string(f) -> str:
    (length,) = struct.unpack("<Q", f.read(8))
    return f.read(length).decode("utf-8", errors="replace")


def _skip_value(f, value_type: int) -> None:
    if value_type == _STRING:
        (length,) = struct.unpack("<Q", f.read(8))
        f.seek(length, os.SEEK_CUR)
    elif value_type == _ARRAY:
        item_type, count = struct.unpack("<IQ", f.read(12))
        if item_type in _SCALAR_SIZES:
            f.seek(count * _SCALAR_SIZES[item_type], os.SEEK_CUR)
        else:
            for _ in range(count):
                _skip_value(f, item_type)
    elif value_type in _SCALAR_SIZES:
        f.seek(_SCALAR_SIZES[value_type], os.SEEK_CUR)
    else:
        raise ValueError(f"unknown GGUF value type {value_type}")
