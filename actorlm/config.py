"""EngineConfig: every engine knob, its default and its validation.

Flags carry vLLM's names where vLLM has one. A config is validated when it is built, and
``resolve()`` fills the values that depend on the model (context length, KV pool size) and checks
them against it; every error names the flag to change.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from actorlm.generation_config import check_overrides as check_generation_overrides
from actorlm.generation_config import check_setting as check_generation_config
from actorlm.json_flags import json_object
from actorlm.pooling import PoolerConfig, check_runner_flags, parse_pooler_config
from actorlm.reasoning import reasoning_parser
from actorlm.structured_outputs_config import StructuredOutputsConfig
from actorlm.sampling_params import LOGPROBS_MODES, MAX_LOGPROBS
from actorlm.speculative import SpeculativeConfig

# --kv-cache-dtype's FP8 choices (vLLM's names; its "fp8" is E4M3)
KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                   "fp8_e5m2": torch.float8_e5m2}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
                  "half": "float16"}
DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30
EXECUTOR_BACKENDS = ("uni", "mp", "ray")
DATA_PARALLEL_BACKENDS = ("mp", "ray")
SCHEDULING_POLICIES = ("fcfs", "priority")  # (core/waiting_queue.py)
LOAD_FORMATS = ("auto", "safetensors", "gguf")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: 2048
    block_size: int = 16
    num_kv_blocks: int | None = None  # exact KV pool size; None: from kv_cache_memory_bytes
    # KV budget in bytes (num_kv_blocks wins over it). None: 2 GiB on a CPU; on a GPU what
    # gpu_memory_utilization leaves once the weights and the largest step's activations are in
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9  # share of the GPU's total memory this engine may use
    enable_chunked_prefill: bool = True
    # reuse the KV of prompt prefixes already computed (vLLM's automatic prefix caching)
    enable_prefix_caching: bool = True
    seed: int = 0
    # ranks the model is sharded over (tensor parallelism), one worker process each
    tensor_parallel_size: int = 1
    # how the workers run: uni (a thread in this process), mp (a process per rank), ray (a Ray
    # actor per rank); None: uni for one rank, mp for more
    distributed_executor_backend: str | None = None
    # a mixture of experts' whole experts placed on the tensor-parallel ranks (each rank holds
    # num_experts / tensor_parallel_size of them), in place of every expert split across ranks
    enable_expert_parallel: bool = False
    # replicas of the whole engine (each an engine core with its own workers and KV pool)
    # behind one frontend, which gives each request to the least loaded; more than one implies
    # engine_core_process
    data_parallel_size: int = 1
    # how the replicas' engine cores run: mp (a process each, on this machine) or ray (a Ray
    # actor each, placed on the cluster at RAY_ADDRESS or a local one)
    data_parallel_backend: str = "mp"
    # the scheduler, the KV allocator and the executor in a process of their own, restarted
    # with their requests resumed if it dies (``actorlm serve``'s default); False: in this
    # process, as vLLM's VLLM_ENABLE_V1_MULTIPROCESSING=0
    engine_core_process: bool = False
    # weights in GGUF blocks: gguf (a .gguf model's own, implied by one), or q8_0 / q4_0 (a
    # Hugging Face directory's linear layers, quantized as they load); None: as the model is
    # (a checkpoint quantized with GPTQ, AWQ or compressed-tensors is read as such, and takes
    # its method's name here too: gptq, awq, compressed-tensors, vLLM's *_marlin)
    quantization: str | None = None
    # the sampling defaults of requests that leave a field out: auto (the model's
    # generation_config.json), vllm (vLLM's own) or a directory holding a generation_config.json
    generation_config: str = "auto"
    # sampling fields set over those (vLLM's --override-generation-config: JSON text or a dict,
    # under the generation config's names), e.g. {"temperature": 0.5, "max_new_tokens": 256}
    override_generation_config: dict | None = None
    # deepseek_r1 | qwen3: chat answers' <think>...</think> goes to reasoning_content, and a
    # grammar constrains only what follows it; None: no reasoning parser
    reasoning_parser: str | None = None
    # how requests' structured outputs are compiled (vLLM's JSON: backend,
    # disable_any_whitespace, …; ``actorlm.structured_outputs_config``)
    structured_outputs_config: StructuredOutputsConfig | None = None  # (JSON text or a dict)
    # draft tokens proposed each step and verified in one forward: vLLM's JSON, e.g.
    # {"method": "ngram", "num_speculative_tokens": 3} (``actorlm.speculative``)
    speculative_config: SpeculativeConfig | None = None  # (given as JSON text or a dict)
    # LoRA adapters (``LoRARequest``): up to max_loras distinct ones in a step, of rank up to
    # max_lora_rank, max_cpu_loras of them kept read in memory (None: max_loras)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # the order requests are served in: fcfs (arrival) or priority (each request's priority,
    # smaller first, then arrival; a request's priority must be 0 under fcfs), vLLM's two
    scheduling_policy: str = "fcfs"
    # the most prompt tokens one request prefills in a step (vLLM's; 0: up to the step's token
    # budget), so that one long prompt leaves room in each step for the others' prefills
    long_prefill_token_threshold: int = 0
    # what the model is run for (vLLM's names): generate, or pooling (embeddings: each
    # request's prompt pooled into one vector, ``actorlm.pooling``); auto: pooling for a
    # checkpoint without an LM head. convert="embed" and the older task="embed" ask for
    # pooling too. Resolved against the model to generate or pooling.
    runner: str = "auto"
    convert: str = "auto"
    task: str | None = None
    # a pooling model's pooling_type (LAST, MEAN, CLS) and normalize, over what its
    # sentence-transformers files say (JSON text or a dict); resolved to a PoolerConfig
    pooler_config: PoolerConfig | None = None  # (given as JSON text or a dict)
    # fields set on the model's config after it is read (vLLM's --hf-overrides: JSON text or
    # a dict), e.g. {"is_matryoshka": true}; what they ask of the math is checked as the
    # config's own fields are
    hf_overrides: dict | None = None
    # a tokenizer's directory in place of the model's own (vLLM's --tokenizer), e.g. a GGUF
    # file's base model's
    tokenizer: str | None = None
    # the most logprobs (and prompt_logprobs) a request may ask for at each position, vLLM's
    # max_logprobs; -1: the whole vocabulary
    max_logprobs: int = MAX_LOGPROBS
    # what logprobs report: the raw logits' logprobs (vLLM's default), the raw logits, or the
    # processed ones (penalties, bias, temperature, top-k/p, min-p: what the token is drawn
    # from) as logprobs or logits
    logprobs_mode: str = "raw_logprobs"
    # what the KV cache stores: the model's dtype (auto), or FP8 (KV_CACHE_DTYPES: half of
    # bf16's bytes a block, each value rounded to it with vLLM's scale of one); and, of vLLM's
    # tokenizer modes, the model's Hugging Face tokenizer files (auto, hf; mistral_common's and
    # the slow ones are refused by name)
    kv_cache_dtype: str = "auto"
    tokenizer_mode: str = "auto"
    # vLLM's --load-format: what the weights are read from; a directory's safetensors and a
    # GGUF file are what this engine reads (auto: whichever the model is)
    load_format: str = "auto"
    # a Hub repository id as the model: the revision (branch, tag, commit) of it, and the
    # Hugging Face cache it is read from (vLLM's --revision, --download-dir); never fetched
    revision: str | None = None
    download_dir: str | None = None

    def __post_init__(self):
        dtype = _DTYPE_ALIASES.get(str(self.dtype).lower(), str(self.dtype).lower())
        if dtype != "auto" and dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of auto, {', '.join(DTYPES)}; got {self.dtype!r}")
        object.__setattr__(self, "dtype", dtype)
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device must be auto, cpu or cuda; got {self.device!r}")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                     "num_kv_blocks", "kv_cache_memory_bytes", "tensor_parallel_size",
                     "data_parallel_size", "max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value <= 0):  # True is an int to Python
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be a positive integer, got {value!r}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype!r} is not implemented "
                             f"(known: auto, {', '.join(KV_CACHE_DTYPES)})")
        if self.tokenizer_mode not in ("auto", "hf"):
            raise ValueError(f"--tokenizer-mode {self.tokenizer_mode!r} is not implemented: the "
                             f"model's Hugging Face tokenizer files are read (auto, hf)")
        self._check_load_format()
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"--logprobs-mode must be one of {', '.join(LOGPROBS_MODES)}; got "
                             f"{self.logprobs_mode!r}")
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or \
                self.max_logprobs < -1:
            raise ValueError(f"--max-logprobs must be -1 (the whole vocabulary) or at least 0, "
                             f"got {self.max_logprobs!r}")
        for name in ("enable_chunked_prefill", "enable_prefix_caching", "enable_expert_parallel",
                     "enable_lora"):
            if not isinstance(getattr(self, name), bool):
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be true or false, got {getattr(self, name)!r}")
        if self.distributed_executor_backend not in (None, *EXECUTOR_BACKENDS):
            raise ValueError(f"--distributed-executor-backend must be one of "
                             f"{', '.join(EXECUTOR_BACKENDS)}; got "
                             f"{self.distributed_executor_backend!r}")
        if self.data_parallel_backend not in DATA_PARALLEL_BACKENDS:
            raise ValueError(f"--data-parallel-backend must be one of "
                             f"{', '.join(DATA_PARALLEL_BACKENDS)}; got "
                             f"{self.data_parallel_backend!r}")
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError("--distributed-executor-backend uni runs one rank; use mp or ray "
                             "for --tensor-parallel-size > 1")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"--block-size must be a power of two, got {self.block_size}")
        utilization = self.gpu_memory_utilization
        if isinstance(utilization, bool) or not isinstance(utilization, (int, float)) or \
                not 0.0 < utilization <= 1.0:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {utilization!r}")
        check_generation_config(self.generation_config)
        outputs = StructuredOutputsConfig.parse(self.structured_outputs_config)
        object.__setattr__(self, "structured_outputs_config", outputs)
        if outputs.reasoning_parser is not None:  # (the same flag under another name)
            if self.reasoning_parser not in (None, outputs.reasoning_parser):
                raise ValueError(f"--structured-outputs-config: reasoning_parser "
                                 f"{outputs.reasoning_parser!r} differs from --reasoning-parser "
                                 f"{self.reasoning_parser!r}")
            object.__setattr__(self, "reasoning_parser", outputs.reasoning_parser)
        if self.reasoning_parser is not None:
            reasoning_parser(self.reasoning_parser)  # unknown: an error listing the known ones
        object.__setattr__(self, "speculative_config",
                           SpeculativeConfig.parse(self.speculative_config))
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"--scheduling-policy must be one of "
                             f"{', '.join(SCHEDULING_POLICIES)}; got {self.scheduling_policy!r}")
        if isinstance(self.long_prefill_token_threshold, bool) or not isinstance(
                self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 0:
            raise ValueError(f"--long-prefill-token-threshold must be 0 (off) or a positive "
                             f"integer, got {self.long_prefill_token_threshold!r}")
        if self.long_prefill_token_threshold and not self.enable_chunked_prefill:
            raise ValueError("--long-prefill-token-threshold splits prompts across steps, "
                             "which needs chunked prefill (--enable-chunked-prefill)")
        check_runner_flags(self.runner, self.convert, self.task)
        object.__setattr__(self, "pooler_config", parse_pooler_config(self.pooler_config))
        object.__setattr__(self, "hf_overrides", _hf_overrides(self.hf_overrides))
        if self.override_generation_config is not None:
            object.__setattr__(self, "override_generation_config", check_generation_overrides(
                json_object(self.override_generation_config, "--override-generation-config")))
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"--max-cpu-loras ({self.max_cpu_loras}) must be at least "
                             f"--max-loras ({self.max_loras})")

    def _check_load_format(self) -> None:
        gguf = self.model is None or str(self.model).endswith(".gguf")  # (None: the default's)
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"--load-format {self.load_format!r} is not implemented: weights "
                             f"are read from a directory's safetensors files or a GGUF file "
                             f"({', '.join(LOAD_FORMATS)})")
        if self.load_format != "auto" and (self.load_format == "gguf") != gguf:
            what = "a GGUF file" if gguf else "not a GGUF file"
            raise ValueError(f"--load-format {self.load_format}: the model is {what}")

    @classmethod
    def from_flags(cls, model: str | None = None, **flags) -> EngineConfig:
        """Build from keyword flags, refusing unknown ones by name."""
        known = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(flags) - known):
            raise ValueError(f"unknown engine flag(s): {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known - {'model'}))}")
        return cls(model=model, **flags)

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def kv_cache_torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype the KV cache stores (auto: the model's)."""
        return KV_CACHE_DTYPES.get(self.kv_cache_dtype, model_dtype)

    def torch_dtype(self, hf_config=None) -> torch.dtype:
        """``--dtype``, or for ``auto`` what fits the hardware: on a GPU the checkpoint's half
        precision (bf16 for an fp32 checkpoint); on a CPU bf16 where the CPU computes it
        natively (AMX, avx512_bf16: 2.3x fp32's speed) and fp32 elsewhere (emulated bf16 is
        2x slower than fp32). The checkpoint's own dtype does not decide on a CPU."""
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        if self.torch_device.type == "cpu":
            return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
        declared = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        declared = DTYPES.get(declared, declared) if isinstance(declared, str) else declared
        return declared if declared in (torch.float16, torch.bfloat16) else torch.bfloat16

    @property
    def is_pooling(self) -> bool:
        """Whether the model runs for embeddings (once resolved against it)."""
        return self.runner == "pooling"

    @property
    def executor_backend(self) -> str:
        """``distributed_executor_backend``, or its default for this many ranks."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "uni" if self.tensor_parallel_size == 1 else "mp"

    @property
    def is_kv_pool_sized_by_user(self) -> bool:
        """Whether a flag sizes the KV pool; if not, a GPU engine profiles its memory."""
        return self.num_kv_blocks is not None or self.kv_cache_memory_bytes is not None

    def resolve_lengths(self, hf_config) -> EngineConfig:
        """Fill max_model_len and max_num_batched_tokens, checked against the model."""
        limit, why = positions_served(hf_config)
        max_model_len = self.max_model_len or limit
        if self.max_model_len is None and \
                limit < (getattr(hf_config, "max_position_embeddings", None) or limit):
            log.info("max_model_len %d: the model's %s", limit, why)
        if max_model_len > limit:
            raise ValueError(f"--max-model-len {max_model_len} exceeds the model's {why}")
        max_batched = self.max_num_batched_tokens or 2048
        if not self.enable_chunked_prefill and max_batched < max_model_len:
            raise ValueError(f"--max-num-batched-tokens ({max_batched}) must be at least "
                             f"--max-model-len ({max_model_len}) when chunked prefill is off")
        return dataclasses.replace(self, max_model_len=max_model_len,
                                   max_num_batched_tokens=max_batched)

    def resolve(self, hf_config, kv_bytes_per_block: int,
                kv_cache_budget_bytes: int | None = None) -> EngineConfig:
        """Fill the model-dependent values and check them against the model. The KV pool is
        ``num_kv_blocks``, else ``kv_cache_memory_bytes``, else ``kv_cache_budget_bytes`` (what
        profiling a GPU left, see ``actorlm.models.memory_profile``), else 2 GiB."""
        resolved = self.resolve_lengths(hf_config)
        max_model_len, max_batched = resolved.max_model_len, resolved.max_num_batched_tokens
        num_blocks = self.num_kv_blocks
        blocks_per_sequence = -(-max_model_len // self.block_size)
        if num_blocks is None and kv_bytes_per_block == 0:
            # an encoder's pool holds no bytes (it caches nothing): its blocks only count
            # the tokens of the prompts in flight, every sequence's worth
            num_blocks = self.max_num_seqs * blocks_per_sequence
        if num_blocks is None:
            budget = self.kv_cache_memory_bytes or kv_cache_budget_bytes or \
                DEFAULT_CPU_KV_CACHE_BYTES
            num_blocks = budget // kv_bytes_per_block
        if num_blocks < blocks_per_sequence:
            raise ValueError(
                f"the KV pool ({num_blocks} blocks of {self.block_size} tokens) cannot hold one "
                f"sequence of --max-model-len {max_model_len}: raise --num-kv-blocks to at least "
                f"{blocks_per_sequence} or lower --max-model-len")
        return dataclasses.replace(self, max_model_len=max_model_len,
                                   max_num_batched_tokens=max_batched, num_kv_blocks=num_blocks)


def _hf_overrides(value) -> dict | None:
    if value is not None:
        value = json_object(value, "--hf-overrides")
    if value and "model_type" in value:
        raise ValueError("--hf-overrides: model_type cannot be overridden (it picks how the "
                         "checkpoint is read)")
    return value or None


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 in hardware (AMX tiles or AVX-512 BF16)."""
    checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")  # torch.cpu, private
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def positions_served(hf_config) -> tuple[int, str]:
    """(the longest context the model is served for, what sets it, in words): its
    max_position_embeddings, or its original_max_position_embeddings where what it computes
    beyond them is not implemented: Llama 4's attention temperature (Ministral 3: the queries
    of later positions scaled by 1 + beta log(1 + floor(position / original)), which is 1
    within), and dynamic NTK scaling (transformers turns every position by a base that grows
    with the sequence once it is longer: a KV cache would hold keys turned by older ones)."""
    rope = getattr(hf_config, "rope_parameters", None) or \
        getattr(hf_config, "rope_scaling", None) or {}
    original = rope.get("original_max_position_embeddings") or \
        getattr(hf_config, "original_max_position_embeddings", None)
    if original and rope.get("llama_4_scaling_beta"):
        return original, (f"original_max_position_embeddings ({original}): beyond it the "
                          f"model takes Llama 4's attention temperature "
                          f"(llama_4_scaling_beta), not implemented")
    limit = getattr(hf_config, "max_position_embeddings", None) or 2048
    if first := first_position_row(hf_config):
        return limit - first, (f"max_position_embeddings ({limit}) less the rows before the "
                               f"first position ({first})")
    if rope.get("rope_type", rope.get("type")) == "dynamic" and not rope.get("alpha"):
        # (Hunyuan's "dynamic" with alpha is a fixed base: every position alike)
        limit = min(limit, original or limit)
        return limit, (f"original context ({limit} positions): beyond it dynamic NTK RoPE "
                       f"scaling turns the positions by a base that grows with the sequence, "
                       f"not implemented")
    return limit, f"max_position_embeddings ({limit})"


def first_position_row(hf_config) -> int:
    """The row of a learned position table that position 0 reads: RoBERTa's count from its
    padding id + 1 (transformers' ``create_position_ids_from_input_ids``), MPNet's from 2 (its
    padding row is 1 whatever the config says), others' from 0."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type in ("roberta", "xlm-roberta"):
        return hf_config.pad_token_id + 1
    return 2 if model_type == "mpnet" else 0
