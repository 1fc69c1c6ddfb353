"""``actorlm bench prefix``: what automatic prefix caching saves, caching on against off.

Two workloads, each run with ``enable_prefix_caching`` on and off in the same process, the
modes taking turns round by round (one engine at a time, shut down in between):

- ``multi_turn``: ``num_conversations`` conversations talk for ``num_turns`` turns. Each
  starts with the application's system prompt (``system_prompt_len`` tokens, the same for all)
  ending in a line of its own. Every turn re-sends the whole conversation so far (earlier
  replies included) through the chat template; a turn's requests are submitted together and
  each decodes ``output_len`` greedy tokens (EOS ignored). Only the shared rules can hit in the
  first turn; later turns find the previous turn's prompt and reply.
- ``shared_prompt``: ``num_questions`` distinct short questions behind one long shared system
  prompt, all submitted together.

Per mode: the prefill tokens the engine computed (its counter), the prompt tokens served from
the cache (summed over the requests' ``num_cached_tokens``; the allocator's ``prefix_cache_*``
counters beside them), TTFT p50 and p90 (every request streams; from its batch's submission to
its first token, as ``bench latency`` measures), output tokens per second and wall time; then
the on/off ratios, and whether both modes generated the same tokens. Each iteration's system
prompts start with its own session line, so no iteration finds an earlier one's blocks.
"""

from __future__ import annotations

import argparse
import itertools
import json
import queue
import statistics
import sys
import time
from dataclasses import dataclass, field

from actorlm.bench.throughput import bench_prompts

WORKLOADS = ("multi_turn", "shared_prompt")
_COUNTERS = ("num_prefill_tokens", "prefix_cache_queries", "prefix_cache_hits")
_RULES = ["Answer in plain, friendly English.", "Keep every answer short and concrete.",
          "Never invent facts; say when you are unsure.", "Prefer examples over definitions.",
          "Use metric units and 24-hour times.", "Ask one clarifying question when needed.",
          "Do not repeat the question back.", "Summarise long answers in one closing line.",
          "Quote numbers with their sources.", "Stay polite when the user is not."]


def system_prompt(tokenizer, head: str, num_tokens: int) -> str:
    """``head``, then numbered house rules until the text is at least ``num_tokens`` tokens."""
    parts = [head]
    for i in itertools.count():
        if len(tokenizer.encode(" ".join(parts), add_special_tokens=False)) >= num_tokens:
            return " ".join(parts)
        parts.append(f"Rule {i + 1}: {_RULES[i % len(_RULES)]}")


def stream_batch(llm, prompts: list[list[int]], params) -> tuple[list[float], list, float]:
    """Submit ``prompts`` together, each streaming: per prompt its time to first token and
    final output, and the time to the last output."""
    from actorlm.messages import SubmitRequest

    sink: queue.Queue = queue.Queue()
    start = time.perf_counter()
    ids = [f"prefix-{i}-{start}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        llm.engine.frontend.ask(SubmitRequest(request_id, prompt, params, sink, True))
    first: dict[str, float] = {}
    final: dict[str, object] = {}
    while len(final) < len(prompts):
        output = sink.get()
        if output.outputs[0].token_ids:
            first.setdefault(output.request_id, time.perf_counter() - start)
        if output.finished:
            final[output.request_id] = output
    return [first[i] for i in ids], [final[i] for i in ids], time.perf_counter() - start


@dataclass
class _Run:
    """One iteration of one workload under one mode."""

    num_prompt_tokens: int = 0
    prefill_per_batch: list[int] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_COUNTERS, 0))
    num_cached_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    wall_s: float = 0.0
    token_ids: list[list[int]] = field(default_factory=list)

    def batch(self, llm, prompts: list[list[int]], params) -> list:
        """Run one batch, adding its counts; returns its outputs."""
        before = llm.stats()
        ttfts, outputs, wall_s = stream_batch(llm, prompts, params)
        after = llm.stats()
        for name in _COUNTERS:
            self.counters[name] += after[name] - before[name]
        self.prefill_per_batch.append(after["num_prefill_tokens"] - before["num_prefill_tokens"])
        self.num_prompt_tokens += sum(map(len, prompts))
        self.num_cached_tokens += sum(o.num_cached_tokens for o in outputs)
        self.ttfts += ttfts
        self.num_output_tokens += sum(len(o.outputs[0].token_ids) for o in outputs)
        self.wall_s += wall_s
        self.token_ids += [o.outputs[0].token_ids for o in outputs]
        return outputs


def multi_turn(llm, session: int, params, num_conversations: int, num_turns: int,
               system_prompt_len: int) -> _Run:
    questions = bench_prompts(num_conversations * num_turns)
    rules = system_prompt(llm.tokenizer, f"Session {session}. You are a patient tutor.",
                          system_prompt_len)
    conversations = [[{"role": "system", "content": f"{rules} Your student is number {c}."}]
                     for c in range(num_conversations)]
    run = _Run()
    for turn in range(num_turns):
        for c, conversation in enumerate(conversations):
            conversation.append(questions[c * num_turns + turn][0])
        prompts = [llm.apply_chat_template(conversation) for conversation in conversations]
        for conversation, output in zip(conversations, run.batch(llm, prompts, params)):
            conversation.append({"role": "assistant", "content": output.outputs[0].text})
    return run


def shared_prompt(llm, session: int, params, num_questions: int, shared_prompt_len: int) -> _Run:
    system = {"role": "system", "content": system_prompt(
        llm.tokenizer, f"Session {session}. You are the help desk of a city library.",
        shared_prompt_len)}
    prompts = [llm.apply_chat_template([system, question[0]])
               for question in bench_prompts(num_questions)]
    run = _Run()
    run.batch(llm, prompts, params)
    return run


def run_prefix(model: str | None, flags: dict, num_conversations: int = 8, num_turns: int = 4,
               output_len: int = 32, system_prompt_len: int = 192, num_questions: int = 16,
               shared_prompt_len: int = 384, num_iters: int = 1,
               workloads: tuple[str, ...] = WORKLOADS) -> dict:
    """Both workloads (or those named in ``workloads``), caching on and off by turns."""
    from actorlm.llm import LLM
    from actorlm.sampling_params import SamplingParams

    if "enable_prefix_caching" in flags:
        raise ValueError("bench prefix runs with caching on and off itself: drop "
                         "--enable-prefix-caching / --no-enable-prefix-caching")
    if min(num_conversations, num_turns, output_len, system_prompt_len, num_questions,
           shared_prompt_len, num_iters) < 1:
        raise ValueError("--num-conversations, --num-turns, --output-len, --system-prompt-len, "
                         "--num-questions, --shared-prompt-len and --num-iters must be at least 1")
    if not workloads or not set(workloads) <= set(WORKLOADS):
        raise ValueError(f"--workload must be among {', '.join(WORKLOADS)}; got {workloads}")
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    run = {"multi_turn": lambda llm, s: multi_turn(llm, s, params, num_conversations, num_turns,
                                                   system_prompt_len),
           "shared_prompt": lambda llm, s: shared_prompt(llm, s, params, num_questions,
                                                         shared_prompt_len)}
    runs: dict[str, dict[str, list[_Run]]] = {name: {"on": [], "off": []} for name in workloads}
    # the modes take turns, each round with an engine of its own, so that a noisy machine
    # slows both alike; each round's prompts are new to its engine (their session line)
    for session in range(num_iters):
        for mode, caching in (("on", True), ("off", False)):
            llm = LLM(model, enable_prefix_caching=caching, **flags)
            try:
                llm.generate("Hello", SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
                for name in workloads:
                    runs[name][mode].append(run[name](llm, session))
                path, dtype = llm.engine.model_path, llm.engine.dtype
            finally:
                llm.shutdown()
    import torch

    result = {"model": path.name, "dtype": str(dtype).removeprefix("torch."),
              "threads": torch.get_num_threads(), "num_iters": num_iters,
              "output_len": output_len}
    sizes = {"multi_turn": {"num_conversations": num_conversations, "num_turns": num_turns,
                            "system_prompt_len": system_prompt_len},
             "shared_prompt": {"num_questions": num_questions,
                               "shared_prompt_len": shared_prompt_len}}
    for name in workloads:
        result[name] = {**sizes[name], **_compare(runs[name]["on"], runs[name]["off"])}
    return result


def _compare(on: list[_Run], off: list[_Run]) -> dict:
    first = on[0]
    out = {"num_requests": len(first.ttfts), "prompt_tokens": first.num_prompt_tokens,
           "output_tokens": first.num_output_tokens, "on": _summary(on), "off": _summary(off)}
    on_s, off_s = out["on"], out["off"]
    out.update(
        prefill_tokens_ratio=_ratio(on_s["prefill_tokens"], off_s["prefill_tokens"]),
        ttft_p50_ratio=_ratio(on_s["ttft_p50_ms"], off_s["ttft_p50_ms"]),
        ttft_p90_ratio=_ratio(on_s["ttft_p90_ms"], off_s["ttft_p90_ms"]),
        throughput_ratio=_ratio(on_s["output_tokens_per_s"], off_s["output_tokens_per_s"]),
        identical_outputs=first.token_ids == off[0].token_ids)
    return out


def _summary(runs: list[_Run]) -> dict:
    """Medians over the iterations (counts are the same in each unless preemption differs)."""

    def median(values) -> float:
        return statistics.median(list(values))

    def count(values) -> int:
        return statistics.median_low(list(values))

    import numpy as np

    ttft = [np.percentile(r.ttfts, [50, 90]) * 1e3 for r in runs]
    return {
        "prefill_tokens": count(sum(r.prefill_per_batch) for r in runs),
        "prefill_tokens_per_batch": runs[0].prefill_per_batch,
        "cached_tokens": count(r.num_cached_tokens for r in runs),
        "prefix_cache_queries": count(r.counters["prefix_cache_queries"] for r in runs),
        "prefix_cache_hits": count(r.counters["prefix_cache_hits"] for r in runs),
        "ttft_p50_ms": round(float(median(t[0] for t in ttft)), 2),
        "ttft_p90_ms": round(float(median(t[1] for t in ttft)), 2),
        "output_tokens_per_s": round(median(r.num_output_tokens / r.wall_s for r in runs), 2),
        "wall_s": round(median(r.wall_s for r in runs), 3),
    }


def _ratio(on: float, off: float) -> float | None:
    return round(on / off, 3) if off else None


def add_prefix_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench's own flags and the engine's (``actorlm bench prefix`` uses the same)."""
    from actorlm.api.flags import add_engine_flags

    add_engine_flags(parser)
    parser.add_argument("--workload", choices=["multi-turn", "shared-prompt", "both"],
                        default="both")
    parser.add_argument("--num-conversations", type=int, default=8)
    parser.add_argument("--num-turns", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=32, help="tokens each request decodes")
    parser.add_argument("--system-prompt-len", type=int, default=192,
                        help="tokens of system prompt the conversations share (multi_turn)")
    parser.add_argument("--num-questions", type=int, default=16)
    parser.add_argument("--shared-prompt-len", type=int, default=384,
                        help="tokens in the system prompt every question shares (shared_prompt)")
    parser.add_argument("--num-iters", type=int, default=1, help="report medians over this many")
    parser.add_argument("--json", action="store_true", help="print one JSON object on one line")


def bench_prefix(args: argparse.Namespace) -> int:
    """Run the bench for parsed arguments and print the result as JSON."""
    from actorlm.api.flags import engine_flags

    workloads = WORKLOADS if args.workload == "both" else (args.workload.replace("-", "_"),)
    result = run_prefix(args.model, engine_flags(args), args.num_conversations, args.num_turns,
                        args.output_len, args.system_prompt_len, args.num_questions,
                        args.shared_prompt_len, args.num_iters, workloads)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m actorlm.bench.prefix",
                                     description=__doc__.split("\n\n")[0])
    add_prefix_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return bench_prefix(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
