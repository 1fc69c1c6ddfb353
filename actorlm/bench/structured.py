"""``actorlm bench structured``: what structured outputs cost, constrained against free text.

One engine, the same chat prompts (``bench throughput``'s), greedy, ``output_len`` tokens at
most: free text, then the same requests under a JSON Schema whose ``story`` string lets the
model write on (so both decode about as many tokens), then under a regex, alternating for
``num_iters`` rounds. Every step of a constrained round fills a token bitmask per request on
the scheduler's thread while the forward runs. Reports output tokens per second per mode (the
median round) and each constrained mode's ratio to free text.
"""

from __future__ import annotations

import statistics
import time

SCHEMA = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                           "story": {"type": "string"}},
          "required": ["title", "story"]}
REGEX = r"[A-Za-z0-9 ,.;:'!?()-]{1,4000}"


def run_structured(model: str | None, flags: dict, num_prompts: int, output_len: int,
                   num_iters: int = 3) -> dict:
    from actorlm.bench.throughput import bench_prompts
    from actorlm.llm import LLM
    from actorlm.sampling_params import SamplingParams, StructuredOutputsParams

    if min(num_prompts, output_len, num_iters) < 1:
        raise ValueError("--num-prompts, --output-len and --num-iters must be at least 1")
    modes = {"free": None, "json_schema": StructuredOutputsParams(json=SCHEMA),
             "regex": StructuredOutputsParams(regex=REGEX)}
    rates: dict[str, list[float]] = {mode: [] for mode in modes}
    tokens: dict[str, int] = {}
    with LLM(model, **flags) as llm:
        prompts = [{"prompt_token_ids": llm.apply_chat_template(c)}
                   for c in bench_prompts(num_prompts)]
        for _ in range(num_iters + 1):  # the first round warms up (and compiles the grammars)
            for mode, constraint in modes.items():
                params = SamplingParams(max_tokens=output_len, temperature=0.0,
                                        structured_outputs=constraint)
                start = time.perf_counter()
                outputs = llm.generate(prompts, params, use_tqdm=False)
                elapsed = time.perf_counter() - start
                tokens[mode] = sum(len(o.outputs[0].token_ids) for o in outputs)
                rates[mode].append(tokens[mode] / elapsed)
        dtype = str(llm.engine.dtype).removeprefix("torch.")
    result = {"model": llm.engine.model_path.name, "dtype": dtype, "num_prompts": num_prompts,
              "output_len": output_len, "num_iters": num_iters}
    free = statistics.median(rates["free"][1:])
    for mode in modes:
        rate = statistics.median(rates[mode][1:])
        result[mode] = {"output_tokens": tokens[mode], "output_tokens_per_s": round(rate, 2)}
        if mode != "free":
            result[mode]["ratio_vs_free"] = round(rate / free, 3)
    return result
