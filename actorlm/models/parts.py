"""A model as the engine's actors see it, and loading one from ``config.model``.

``load_model_parts`` resolves the model and the configuration against it (context length, KV
pool size) and returns ``ModelParts``: the tokenizer, the vocabulary, the EOS ids, the KV-cache
groups the block pool serves (``actorlm.kv_groups``: a block is one page in each layer of a
group, so the pool's size counts a group's layers, not all of them), and
``make_runner(rank)``, which builds a worker's model runner (weights and KV cache). The weights
load in ``make_runner`` — on a thread that exits, see ``actorlm.openmp`` — except on a GPU with
no KV pool size given: there they load first, so that the largest step can be profiled and the
pool given what is left (``actorlm.models.memory_profile``), and that model becomes rank 0's first
runner. A worker restarted later loads afresh.

With ``--tensor-parallel-size N`` each rank's runner holds 1/N of the model and of the KV cache
(``actorlm.models.parallel``; with ``--enable-expert-parallel`` 1/N of the routed experts,
whole, ``actorlm.models.expert_parallel``); the split is checked here, before anything heavy
loads.
"""

from __future__ import annotations

import logging
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from transformers import AutoTokenizer, GenerationConfig

from actorlm.config import EngineConfig
from actorlm.kernels import select_backend
from actorlm.kv_groups import KVCacheGroup, kv_cache_groups
from actorlm.models.loader import (check_block_split, check_quantization, load_hf_config,
                                   load_model, resolve_model)
from actorlm.models.parallel import (TensorParallel, check_initialised, check_tensor_parallel,
                                     num_kv_heads_per_rank)
from actorlm.models.encoder import attends_both_ways, cache_windows
from actorlm.models.expert_parallel import check_expert_parallel, split_intermediate_sizes
from actorlm.models.families import head_dim_of, long_rope_from, num_kv_heads_of
from actorlm.models.memory_profile import MemoryProfile, kv_cache_budget, largest_step, load_and_profile
from actorlm.models.draft_proposer import DraftModelProposer, check_draft_vocabulary
from actorlm.models.lora_slots import LoRASlots
from actorlm.models.ngram_proposer import NgramProposer
from actorlm.models.runner import ModelRunner
from actorlm.openmp import on_passing_thread
from actorlm.pooling import PoolerConfig, pooler_config, wants_pooling
from actorlm.speculative import SpeculativeConfig
from actorlm.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


def model_geometry(hf_config) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) as the KV cache sees them."""
    return hf_config.num_hidden_layers, num_kv_heads_of(hf_config), head_dim_of(hf_config)


def eos_token_ids(path, tokenizer) -> frozenset[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:
        eos = None
    ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return frozenset(ids)


def kv_bytes_per_block(hf_config, block_size: int, tp_size: int, dtype: torch.dtype,
                       num_layers: int | None = None) -> int:
    """A KV block's bytes on one rank: ``num_layers`` (default: every layer) pages of K and
    V, each rank holding its share of the KV heads."""
    if attends_both_ways(hf_config):  # (it caches nothing)
        return 0
    layers, num_kv_heads, head_dim = model_geometry(hf_config)
    return 2 * (num_layers or layers) * block_size * \
        num_kv_heads_per_rank(num_kv_heads, tp_size) * head_dim * \
        torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class ModelParts:
    """A model as the actors see it. ``EngineSystem`` loads one from ``config.model``; tests and
    tools may pass their own (``actorlm.testing`` brings a fake runner and a toy tokenizer)."""

    name: str
    tokenizer: Any
    make_runner: Callable[[int], Any]  # rank -> an object with execute(ScheduleStep) -> StepResult
    vocab_size: int
    eos_token_ids: frozenset[int] = frozenset()
    # the model's KV-cache groups (``actorlm.kv_groups``), which the block pool serves; empty:
    # one full-attention group of every layer
    kv_cache_groups: tuple[KVCacheGroup, ...] = ()
    # a LongRoPE model's original context (``families.long_rope_from``): the KV of a prompt
    # longer than it is computed by other factors, so cached apart
    long_rope_from: int | None = None


@dataclass(frozen=True)
class RunnerFactory:
    """``make_runner(rank)`` for a checkpoint: builds a worker's model runner (weights and KV
    cache) in the calling process. Plain data, so it can be sent to a worker process and
    called there; ``profiled`` (a GPU's runner loaded to size the KV pool, handed to rank 0
    once) stays behind in the process that loaded it. With ``tensor_parallel_size`` > 1 the
    runner is rank ``rank``'s shard, in a process that has called ``init_tensor_parallel``
    (its routed experts whole, a share of them, with ``enable_expert_parallel``)."""

    path: Any
    dtype: torch.dtype
    device: torch.device
    block_size: int
    eos_token_ids: frozenset[int]
    num_kv_blocks: int = 0
    tensor_parallel_size: int = 1
    quantization: str | None = None
    enable_expert_parallel: bool = False
    speculative_config: SpeculativeConfig | None = None
    draft_path: Any = None  # the draft model's directory (``speculative_config.model``'s)
    lora: tuple[int, int, int | None] | None = None  # max_loras, max_lora_rank, max_cpu_loras
    pooler: PoolerConfig | None = None  # a pooling model's (resolved); None: it generates
    hf_overrides: dict | None = None  # (--hf-overrides, set on the config it reads)
    logprobs_mode: str = "raw_logprobs"  # (--logprobs-mode, ``models/sampler.py``)
    kv_cache_dtype: torch.dtype | None = None  # (--kv-cache-dtype); None: the model's
    profiled: list = field(default_factory=list, compare=False)

    def __call__(self, rank: int) -> ModelRunner:
        if rank == 0 and self.profiled:  # once: a restarted worker loads afresh
            runner = self.profiled.pop()
            runner.allocate_kv_cache(self.num_kv_blocks)
            return runner
        tp = TensorParallel(rank, self.tensor_parallel_size, self.enable_expert_parallel) \
            if self.tensor_parallel_size > 1 \
            else TensorParallel()  # (one rank: every worker holds the whole model)
        check_initialised(tp)
        return self.build(load_model(self.path, self.dtype, self.device, self.backend, tp,
                                     self.quantization,
                                     pooling=self.pooler.task if self.pooler else None,
                                     hf_overrides=self.hf_overrides),
                          self.num_kv_blocks)

    @property
    def backend(self):
        return select_backend(self.device)

    def build(self, model, num_blocks: int) -> ModelRunner:
        proposer = self._proposer(model)
        lora_slots = None if self.lora is None else LoRASlots(model, *self.lora)
        return ModelRunner(model, self.backend, num_blocks, self.block_size, self.dtype,
                           self.device, self.eos_token_ids, model.tp, proposer, lora_slots,
                           self.pooler, self.logprobs_mode, self.kv_cache_dtype)

    def _proposer(self, model):
        spec = self.speculative_config
        if spec is None:
            return None
        if spec.method == "ngram":
            return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                                 spec.prompt_lookup_max)
        if not model.tp.is_driver:  # rank 0 proposes; the other ranks read its drafts
            return None
        draft = load_model(self.draft_path, self.dtype, self.device, self.backend)
        return DraftModelProposer(draft, self.backend, spec.num_speculative_tokens,
                                  self.block_size, self.dtype, self.device, self.kv_cache_dtype)

    def __getstate__(self):
        return {**self.__dict__, "profiled": []}

    def __setstate__(self, state):
        self.__dict__.update(state)


@dataclass(frozen=True)
class LoadedModel:
    """What ``load_model_parts`` found out besides the parts themselves."""

    parts: ModelParts
    config: EngineConfig  # resolved against the model
    path: Any  # the model's directory
    hf_config: Any
    dtype: torch.dtype
    device: torch.device
    backend_name: str
    memory_profile: MemoryProfile | None  # where a GPU's KV pool was sized by profiling


def resolve_runner(config: EngineConfig, path, hf_config) -> EngineConfig:
    """``config`` with ``runner`` generate or pooling for this model, and a pooling model's
    ``pooler_config`` resolved (``actorlm.pooling``). What pooling does not combine with is
    refused; prefix caching stays on only for last-token pooling, where a cached prefix
    leaves the last token to compute (a mean or the first token's state needs them all). An
    encoder computes each prompt in one step, whole: no prefix caching, no chunked prefill,
    its first token's state pooled unless its files say otherwise (vLLM's default for BERT)."""
    if not wants_pooling(config.runner, config.convert, config.task, hf_config):
        if config.pooler_config is not None:
            raise ValueError(f"--pooler-config applies to a pooling model; {path.name} runs "
                             f"to generate (--runner pooling embeds with it)")
        return dataclasses.replace(config, runner="generate")
    for flag, on in (("--speculative-config", config.speculative_config is not None),
                     ("--enable-lora", config.enable_lora)):
        if on:
            raise ValueError(f"{flag} with a pooling model (--runner pooling) is not "
                             f"implemented")
    encoder = attends_both_ways(hf_config)
    # (an encoder pools its first token's state, or as its classifier says: ModernBERT's)
    pooler = pooler_config(path, hf_config, config.pooler_config, config.convert,
                           ("MEAN" if getattr(hf_config, "classifier_pooling", "cls") == "mean"
                            else "CLS") if encoder else "LAST")
    log.info("pooling model (%s): %s pooling%s", pooler.task, pooler.pooling_type,
             ", normalized" if pooler.normalize else "")
    if encoder:  # a prompt in one step, whole (``models/encoder.py``)
        return dataclasses.replace(config, runner="pooling", pooler_config=pooler,
                                   enable_prefix_caching=False, enable_chunked_prefill=False,
                                   max_num_batched_tokens=config.max_num_batched_tokens or max(
                                       2048, getattr(hf_config, "max_position_embeddings", 0)))
    return dataclasses.replace(config, runner="pooling", pooler_config=pooler,
                               enable_prefix_caching=config.enable_prefix_caching
                               and pooler.pooling_type == "LAST")


def load_model_parts(config: EngineConfig) -> LoadedModel:
    """Resolve ``config.model`` and the config against it; see the module's docstring."""
    path = resolve_model(config.model, config.revision, config.download_dir)
    hf_config = load_hf_config(path, config.hf_overrides)
    config = resolve_runner(config, path, hf_config)
    _, num_kv_heads, _ = model_geometry(hf_config)
    tp_size, expert_parallel = config.tensor_parallel_size, config.enable_expert_parallel
    check_expert_parallel(path.name, hf_config, tp_size, expert_parallel)
    check_tensor_parallel(path.name, hf_config.num_attention_heads, num_kv_heads,
                          split_intermediate_sizes(hf_config, expert_parallel), tp_size)
    check_quantization(path, config.quantization)
    check_block_split(path, hf_config, config.quantization, tp_size, expert_parallel)
    device, dtype = config.torch_device, config.torch_dtype(hf_config)
    kv_dtype = config.kv_cache_torch_dtype(dtype)
    if config.dtype == "auto":
        log.info("--dtype auto: %s on this %s", str(dtype).removeprefix("torch."),
                 "CPU (native bf16)" if device.type == "cpu" and dtype == torch.bfloat16
                 else device.type.upper())
    # a block id is one page in each of a group's layers, and every group has as many layers
    # (their KV tensors are shared); each rank holds its share of the KV heads, so the pool
    # is sized per rank
    groups = tuple(kv_cache_groups(cache_windows(hf_config)))
    bytes_per_block = kv_bytes_per_block(hf_config, config.block_size, tp_size, kv_dtype,
                                         max(len(g.layers) for g in groups))
    profile_gpu = device.type == "cuda" and not config.is_kv_pool_sized_by_user
    # profiling loads the whole model in this process, where only a worker thread reuses it
    # (a worker process would load the weights a second time beside the profiled copy)
    if profile_gpu and config.executor_backend != "uni":
        what = f"--tensor-parallel-size {tp_size}" if tp_size > 1 else \
            f"--distributed-executor-backend {config.executor_backend}"
        raise ValueError(f"{what} on a GPU needs the KV pool sized by --num-kv-blocks or "
                         f"--kv-cache-memory-bytes (per rank)")
    tokenizer = load_tokenizer(path, config.tokenizer, hf_config.vocab_size)
    draft_path = None
    spec = config.speculative_config
    if spec is not None and spec.method == "draft_model":  # checked before anything loads
        draft_path = resolve_model(spec.model, download_dir=config.download_dir)
        draft_config = load_hf_config(draft_path)
        check_draft_vocabulary(spec.model, tokenizer, AutoTokenizer.from_pretrained(draft_path),
                               hf_config.vocab_size, draft_config.vocab_size)
        # its own KV pool has as many blocks as the target's (rank 0 holds it), of the same
        # dtype (as vLLM's)
        bytes_per_block += kv_bytes_per_block(draft_config, config.block_size, 1, kv_dtype)
    # flags are checked against the model before anything heavy loads
    resolved = config.resolve_lengths(hf_config) if profile_gpu else \
        config.resolve(hf_config, bytes_per_block)
    backend = select_backend(device)
    eos_ids = eos_token_ids(path, tokenizer)
    block_size = config.block_size

    factory = RunnerFactory(path, dtype, device, block_size, eos_ids,
                            tensor_parallel_size=tp_size, quantization=config.quantization,
                            enable_expert_parallel=expert_parallel,
                            speculative_config=spec, draft_path=draft_path,
                            lora=(config.max_loras, config.max_lora_rank, config.max_cpu_loras)
                            if config.enable_lora else None, pooler=config.pooler_config,
                            hf_overrides=config.hf_overrides, logprobs_mode=config.logprobs_mode,
                            kv_cache_dtype=kv_dtype if kv_dtype != dtype else None)
    profile = None
    if profile_gpu:
        step = largest_step(resolved.max_num_batched_tokens, resolved.max_num_seqs,
                            block_size, resolved.max_model_len, len(groups))
        runner, profile = on_passing_thread(  # off this thread, as make_runner (see openmp)
            load_and_profile,
            lambda: load_model(path, dtype, device, factory.backend, quantization=config.quantization,
                               pooling=config.pooler_config.task if config.is_pooling
                               else None, hf_overrides=config.hf_overrides),
            factory.build, step, device)
        budget = kv_cache_budget(profile.total_bytes, profile.used_bytes,
                                 profile.peak_activation_bytes, config.gpu_memory_utilization)
        log.info("GPU memory: %.2f GiB total, %.2f GiB in use after loading the weights, "
                 "%.2f GiB peak activations; %.2f GiB for the KV cache "
                 "(--gpu-memory-utilization %s)", profile.total_bytes / 2**30,
                 profile.used_bytes / 2**30, profile.peak_activation_bytes / 2**30,
                 budget / 2**30, config.gpu_memory_utilization)
        resolved = config.resolve(hf_config, bytes_per_block, budget)
        factory = dataclasses.replace(factory, profiled=[runner])
    factory = dataclasses.replace(factory, num_kv_blocks=resolved.num_kv_blocks)

    parts = ModelParts(f"{path.name} ({dtype}, {backend.name})", tokenizer, factory,
                       hf_config.vocab_size, eos_ids, groups, long_rope_from(hf_config))
    return LoadedModel(parts, resolved, path, hf_config, dtype, device, backend.name, profile)
