"""LLM: the offline, synchronous facade over the actor system (vLLM's ``LLM`` interface)."""

from __future__ import annotations

import functools
import itertools
import queue
import time
import weakref
from typing import Sequence

import msgspec
import pykka
import torch
from tqdm.auto import tqdm

from actorlm.actors.supervisor import EngineDeadError
from actorlm.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from actorlm.actors.system import EngineSystem
from actorlm.chat_content import check_content_format
from actorlm.config import EngineConfig
from actorlm.engine_core import start_engine
from actorlm.engine_metrics import RequestMetrics, with_kv_usage
from actorlm.lora_request import LoRARequest
from actorlm.messages import AbortRequests, SubmitRequest
from actorlm.metrics_reader import Metric, snapshot
from actorlm.models.gguf_file import model_name
from actorlm.outputs import (ClassificationRequestOutput, EmbeddingRequestOutput, PoolingOutput,
                             PoolingRequestOutput, RequestOutput, ScoringOutput,
                             ScoringRequestOutput)
from actorlm.pooling import NOTHING_SAMPLED, TASKS, PoolingParams
from actorlm.prompt_rules import open_and_closed
from actorlm.request_timing import observe_finished_output
from actorlm.sampling_params import SamplingParams

PromptType = str | list[int] | dict

class LLM:
    """``LLM(model=None, **engine_flags)``; ``model=None`` is the embedded SmolLM2-135M-Instruct.

    Engine flags carry vLLM's names (``dtype``, ``max_model_len``, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``block_size``, ``seed``, …) plus ``num_kv_blocks``.
    ``trace_file``: record the run (``actorlm.trace``) as JSON lines there; the file is
    complete whenever ``generate`` returns. ``llm.trace`` is the recorder (None when off).
    ``generation_config`` (``auto``, ``vllm`` or a directory) picks the sampling defaults that
    ``generate`` uses when given no ``sampling_params`` (``get_default_sampling_params()``).
    ``disable_log_stats=False`` keeps vLLM's metrics of the engine and its requests, which
    ``get_metrics()`` returns (off by default, as in vLLM's ``LLM``).

    Like vLLM's, it needs no ``shutdown()``: the engine stops when the object is collected or
    the process ends (``shutdown()`` and ``with LLM(...) as llm:`` stop it sooner). If the
    engine dies, ``generate`` raises ``EngineDeadError`` instead of waiting.
    """

    def __init__(self, model: str | None = None, *, trace_file: str | None = None,
                 disable_log_stats: bool = True, **engine_flags):
        config = EngineConfig.from_flags(model, **engine_flags)
        self.trace = None
        if trace_file is not None:
            from actorlm.trace import TraceRecorder

            self.trace = TraceRecorder(path=trace_file)
        try:
            self.engine = start_engine(config, trace=self.trace)
        except BaseException:
            if self.trace is not None:
                self.trace.close()
            raise
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()
        # (reads the engine, not self: a forgotten LLM is still collected)
        self._metrics = None if disable_log_stats else RequestMetrics(
            self.config.model or model_name(self.engine.model_path),  # (the embedded: its stem)
            functools.partial(_read_engine, self.engine, self.config))
        # holds the engine, not self: a forgotten LLM is collected, and its engine stopped
        self._finalizer = weakref.finalize(self, stop_engine, self.engine, self.trace)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order. ``lora_request``: the
        LoRA adapter of every prompt, or one per prompt (None: the base model; needs
        ``enable_lora``). ``priority``: one per prompt, smaller served first (needs
        ``scheduling_policy="priority"``; None: all 0).

        A prompt is text, a list of token ids, or a dict of ``"prompt"`` or
        ``"prompt_token_ids"``, with vLLM's ``"cache_salt"`` if it is to share cached prefixes
        only with prompts of the same salt (one tenant's). If any prompt
        or parameter is refused, nothing of this call keeps running and the error is raised.
        Without ``sampling_params`` the model's defaults apply (``get_default_sampling_params``).
        """
        prompts = _as_list(prompts)
        params = sampling_params if sampling_params is not None else \
            self.get_default_sampling_params()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling_params")
        loras = [lora_request] * len(prompts) if lora_request is None or \
            isinstance(lora_request, LoRARequest) else list(lora_request)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(loras)} lora_requests")
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priority)} priorities")
        return self._run(prompts, params, loras, priority, [None] * len(prompts), use_tqdm)

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (``outputs.embedding``), in prompt order, from a pooling
        model (``runner="pooling"``, ``actorlm.pooling``). ``pooling_params``: one for all or
        one per prompt (``dimensions``, ``normalize``)."""
        return self._pool(prompts, pooling_params, "embed", use_tqdm)

    def classify(self, prompts: PromptType | Sequence[PromptType],
                 pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
                 use_tqdm: bool = True) -> list[ClassificationRequestOutput]:
        """Each prompt's class probabilities (``outputs.probs``), in prompt order, from a
        ``...ForSequenceClassification`` checkpoint (``use_activation=False``: its logits)."""
        return self._pool(prompts, pooling_params, "classify", use_tqdm)

    def encode(self, prompts: PromptType | Sequence[PromptType],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
               use_tqdm: bool = True, *,
               pooling_task: str | None = None) -> list[PoolingRequestOutput]:
        """vLLM's generic pooling call: each prompt's pooled output as a tensor
        (``outputs.data``), in prompt order. ``pooling_task``: "embed" (the vector, as
        ``embed``), "classify" (the probabilities, as ``classify``), or None for the model's
        task; the per-token tasks are not implemented, and are refused by name."""
        pooler = self.config.pooler_config
        task = pooling_task or (pooler.task if pooler is not None else "embed")
        if task not in TASKS:
            raise ValueError(f"pooling_task: {task!r} is not implemented here (only "
                             f"{', '.join(TASKS)})")
        return [PoolingRequestOutput(o.request_id, PoolingOutput(torch.tensor(o.outputs.values)),
                                     o.prompt_token_ids, o.finished, o.num_cached_tokens, o.error)
                for o in self._pool(prompts, pooling_params, task, use_tqdm)]

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str],
              use_tqdm: bool = True) -> list[ScoringRequestOutput]:
        """How well each pair matches (vLLM's ``LLM.score``): one text against each of the
        others, or pairs position by position. A cross-encoder (a classifier of one label)
        reads each pair together, as its tokenizer joins them, and gives its probability; an
        embedding model gives the cosine similarity of the two texts' vectors."""
        pairs = score_pairs(data_1, data_2)
        pooler = self.config.pooler_config
        if pooler is None or pooler.task == "embed":
            texts = list(dict.fromkeys(t for pair in pairs for t in pair))
            vectors = dict(zip(texts, self.embed(texts, use_tqdm=use_tqdm)))
            return [ScoringRequestOutput(vectors[a].request_id,
                                         ScoringOutput(cosine(vectors[a], vectors[b])),
                                         vectors[a].prompt_token_ids, True) for a, b in pairs]
        if (labels := self.engine.hf_config.num_labels) != 1:
            raise ValueError(f"score needs a cross-encoder (a classifier of one label); this "
                             f"one has {labels} labels: classify gives their probabilities")
        prompts = [{"prompt_token_ids": self.tokenizer(a, b)["input_ids"]} for a, b in pairs]
        return [ScoringRequestOutput(o.request_id, ScoringOutput(o.outputs.probs[0]),
                                     o.prompt_token_ids, o.finished)
                for o in self.classify(prompts, use_tqdm=use_tqdm)]

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    lora_request: LoRARequest | None = None,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """The ``beam_width`` best continuations of each prompt (vLLM's ``LLM.beam_search``,
        ``actorlm.beam_search``): each ``sequences[i]`` holds its prompt's and its generated
        ``tokens``, their ``cum_logprob`` and their ``text``, best first. Every step runs the
        live beams of all prompts as one batch of one-token requests."""
        prompts = _as_list(prompts)
        step = params.step_params(self.config.max_logprobs)
        # the first step tokenizes and checks the prompts as generate does
        firsts = self.generate(prompts, step, use_tqdm=False, lora_request=lora_request)
        searches = [BeamSearch(out.prompt_token_ids, params, self.engine.eos_token_ids,
                               self.config.max_model_len) for out in firsts]
        for search, out in zip(searches, firsts):
            search.advance([_succeeded(out)])
        salts = [prompt_salt(prompt) for prompt in prompts]
        with tqdm(total=params.max_tokens, initial=1, desc="Beam search", unit="step",
                  disable=not use_tqdm) as bar:
            while live := [(search, salt) for search, salt in zip(searches, salts)
                           if not search.done]:
                beams = [salted(beam.tokens, salt) for search, salt in live
                         for beam in search.beams]
                outs = iter(self.generate(beams, step, use_tqdm=False,
                                          lora_request=lora_request))
                for search, _ in live:
                    search.advance([_succeeded(next(outs)) for _ in search.beams])
                bar.update(1)
        results = []
        for search in searches:
            best = search.best()
            for beam in best:
                beam.text = self.tokenizer.decode(beam.tokens, skip_special_tokens=True)
            results.append(BeamSearchOutput(best))
        return results

    def _pool(self, prompts, pooling_params, task: str, use_tqdm: bool) -> list:
        """Submit every prompt as a pooling request of ``task``; wait for all the outputs."""
        prompts = _as_list(prompts)
        pooling = pooling_params if pooling_params is not None else PoolingParams()
        pooling = [pooling] * len(prompts) if isinstance(pooling, PoolingParams) else list(pooling)
        if len(pooling) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(pooling)} pooling_params")
        pooling = [msgspec.structs.replace(p, task=task) for p in pooling]
        return self._run(prompts, [NOTHING_SAMPLED] * len(prompts), [None] * len(prompts),
                         [0] * len(prompts), pooling, use_tqdm)

    def _run(self, prompts: list, params: list[SamplingParams], loras: list, priority: list[int],
             pooling: list[PoolingParams | None], use_tqdm: bool) -> list:
        """Submit every prompt (or, if one is refused, none) and wait for all the outputs."""
        sink: queue.Queue = queue.Queue()
        request_ids = self._submit(prompts, params, sink, loras, priority, pooling)
        watch = self.engine.supervisor.watch(sink.put)  # a dead engine wakes us with its error
        by_id: dict[str, RequestOutput | EmbeddingRequestOutput] = {}
        try:
            with tqdm(total=len(request_ids), desc="Processed prompts", unit="req",
                      disable=not use_tqdm) as bar:
                while len(by_id) < len(request_ids):
                    output = sink.get()
                    if isinstance(output, EngineDeadError):
                        raise output
                    by_id[output.request_id] = output
                    if self._metrics is not None:
                        observe_finished_output(self._metrics, output, time.monotonic())
                    bar.update(1)
        except BaseException:  # Ctrl-C in a notebook, say: what is left stops running
            self._abort([rid for rid in request_ids if rid not in by_id])
            raise
        finally:
            self.engine.supervisor.unwatch(watch)
        self.flush_trace()
        return [by_id[rid] for rid in request_ids]

    def _submit(self, prompts: list, params: list[SamplingParams], sink,
                loras: list[LoRARequest | None], priority: list[int],
                pooling: list[PoolingParams | None]) -> list[str]:
        """Submit every prompt or, if one is refused, none (the others are aborted)."""
        request_ids: list[str] = []
        try:
            for prompt, p, lora, rank, pool in zip(prompts, params, loras, priority, pooling):
                request_id = str(next(self._ids))
                self.engine.frontend.ask(SubmitRequest(request_id, prompt_input(prompt), p, sink,
                                                       lora_request=lora,
                                                       cache_salt=prompt_salt(prompt),
                                                       priority=rank, pooling_params=pool))
                request_ids.append(request_id)
        except pykka.ActorDeadError:
            raise self.engine.supervisor.dead_error() from None
        except Exception:
            self._abort(request_ids)
            raise
        return request_ids

    def _abort(self, request_ids: list[str]) -> None:
        try:
            self.engine.frontend.tell(AbortRequests(request_ids))
        except pykka.ActorDeadError:
            pass  # nothing runs any more

    def flush_trace(self) -> None:
        """Write the trace file up to now, including the blocks the last step returned."""
        if self.trace is not None:
            # the allocator answers after the last free it was sent; the scheduler then after
            # that grant: both asks together wait for the engine to settle
            self.engine.kv_stats()
            self.engine.scheduler_stats()
            self.trace.flush()

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None, *,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None,
             chat_template_content_format: str = "auto") -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the chat template
        (vLLM's arguments: ``continue_final_message`` leaves the last message open for the model
        to carry on, instead of opening the assistant's turn; ``chat_template_content_format``:
        the messages' content as a string or a list of parts, ``auto`` as the template reads
        it, see ``chat_content``)."""
        check_content_format(chat_template_content_format, "chat_template_content_format")
        if not messages:
            raise ValueError("messages: the conversation is empty")
        if error := open_and_closed(add_generation_prompt, continue_final_message):
            raise ValueError(error)
        kwargs = {**(chat_template_kwargs or {}),
                  **({"continue_final_message": True} if continue_final_message else {}),
                  **({"chat_template": chat_template} if chat_template is not None else {}),
                  **({"tools": tools} if tools else {})}
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": self.engine.apply_chat_template(
            c, add_generation_prompt, chat_template_content_format, **kwargs)}
            for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt=True) -> list[int]:
        return self.engine.apply_chat_template(conversation, add_generation_prompt)

    def get_tokenizer(self):
        """The Hugging Face tokenizer the engine encodes, renders chats and decodes with (this
        thread's copy of it), as vLLM's ``LLM.get_tokenizer``."""
        return self.tokenizer.for_this_thread

    def get_default_sampling_params(self) -> SamplingParams:
        """The model's sampling defaults (its generation_config.json, per ``generation_config``)
        on top of SamplingParams' own, as vLLM's ``LLM.get_default_sampling_params``."""
        return self.engine.sampling_defaults.sampling_params()

    def stats(self) -> dict:
        """Scheduler and KV pool counters (for tests, metrics and the curious)."""
        return self.engine.stats()

    def get_metrics(self) -> list[Metric]:
        """vLLM's snapshot of the engine's metrics now (``metrics_reader``'s records: counters,
        gauges, histograms, vectors, under vLLM's names), for an LLM built with
        ``disable_log_stats=False``. The latencies are each finished request's (no
        inter-token latency: offline, a request's output comes once, whole)."""
        if self._metrics is None:
            raise ValueError("get_metrics: stat logging is disabled; build the LLM with "
                             "disable_log_stats=False")
        return snapshot(self._metrics.registry)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix (vLLM's ``LLM.reset_prefix_cache``)."""
        return self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the engine now (idempotent)."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _read_engine(engine: EngineSystem, config: EngineConfig):
    """(config, each replica's stats) for the metrics, or None once the engine is gone."""
    if engine.supervisor.error is not None:
        return None
    try:
        return config, [with_kv_usage(stats) for stats in engine.replica_stats()]
    except pykka.ActorDeadError:
        return None


def stop_engine(engine: EngineSystem, trace=None) -> None:
    engine.stop()
    if trace is not None:
        trace.close()


def _succeeded(output: RequestOutput) -> RequestOutput:
    """A beam's one-token step, unless the engine failed it."""
    if output.error:
        raise RuntimeError(f"the engine failed a beam's step: {output.error}")
    return output


def _as_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int):  # one prompt given as token ids
        return [prompts]
    return prompts


def score_pairs(data_1, data_2) -> list[tuple[str, str]]:
    """vLLM's pairing: one text against each of the others, else position by position."""
    firsts = [data_1] if isinstance(data_1, str) else list(data_1)
    seconds = [data_2] if isinstance(data_2, str) else list(data_2)
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds) or not seconds:
        raise ValueError(f"score: data_1 ({len(firsts)}) must be one text or as many as "
                         f"data_2 ({len(seconds)}), and data_2 not empty")
    return list(zip(firsts, seconds))


def cosine(a: EmbeddingRequestOutput, b: EmbeddingRequestOutput) -> float:
    import numpy as np

    u, v = np.asarray(a.outputs.embedding), np.asarray(b.outputs.embedding)
    return float(u @ v / (np.linalg.norm(u) * np.linalg.norm(v)))


def salted(token_ids: list[int], salt: str | None) -> PromptType:
    """Token ids as a prompt of the prefix-cache tenant ``salt`` (None: shared)."""
    return token_ids if salt is None else {"prompt_token_ids": token_ids, "cache_salt": salt}


def prompt_salt(prompt: PromptType) -> str | None:
    """A dict prompt's ``cache_salt`` (vLLM's): its prefix-cache tenant; None: shared."""
    return prompt.get("cache_salt") if isinstance(prompt, dict) else None


def prompt_input(prompt: PromptType) -> str | list[int]:
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"]
        raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, (str, list)):
        return prompt
    raise ValueError(f"prompt: expected text, token ids or a dict, got {type(prompt).__name__}")
