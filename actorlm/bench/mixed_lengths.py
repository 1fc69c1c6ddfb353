"""What one long request costs a decode step of short ones.

A decode step of ``num_short`` requests at context ``short_len``, timed with and without one
more request at context ``long_len`` (the model runner alone, no scheduler: the contexts are
declared computed, so no prefill runs; attention reads whatever the KV cache holds). With
attention proportional to the tokens attended, the long request costs its own context and no
more; padded to the longest context, it used to cost every short one ``long_len`` positions.

    python -m actorlm.bench.mixed_lengths [--model DIR] [--dtype float32] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from actorlm.messages import CachedRequestData, NewRequestData, ScheduleStep
from actorlm.sampling_params import SamplingParams


def step_costs(model_dir=None, dtype: str = "float32", num_short: int = 63,
               short_len: int = 100, long_len: int = 7000, num_steps: int = 5) -> dict:
    """Median seconds of a decode step without and with the long request."""
    from actorlm.kernels import select_backend
    from actorlm.models.loader import load_model, resolve_model
    from actorlm.models.runner import ModelRunner

    block_size, device = 16, torch.device("cpu")
    lengths = [short_len + i % 7 for i in range(num_short)] + [long_len]
    blocks_each = [-(-(n + 2 * num_steps + 2) // block_size) for n in lengths]
    backend = select_backend(device)
    model = load_model(resolve_model(model_dir), getattr(torch, dtype), device, backend)
    num_groups = len(getattr(model, "kv_cache_groups", None) or [None])
    runner = ModelRunner(model, backend, num_groups * sum(blocks_each), block_size, model.dtype,
                         device)
    greedy = SamplingParams(temperature=0.0, max_tokens=1 << 20)
    new, first = [], 0
    for i, (n, num_blocks) in enumerate(zip(lengths, blocks_each)):
        tables = []  # one per KV-cache group
        for _ in range(num_groups):
            tables.append(list(range(first, first + num_blocks)))
            first += num_blocks
        new.append(NewRequestData(f"r{i}", [7 + (i + j) % 50 for j in range(n)], n, tables,
                                  n - 1, greedy, 0))
    runner.execute(ScheduleStep(0, new, [], [1] * len(new), []))  # also the warm-up

    def median_step(ids: list[str]) -> float:
        times = []
        for step in range(num_steps):
            cached = [CachedRequestData(rid, [], len(runner.requests[rid].token_ids) - 1)
                      for rid in ids]
            start = time.perf_counter()
            runner.execute(ScheduleStep(step, [], cached, [1] * len(ids), []))
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    short_ids = [f"r{i}" for i in range(num_short)]
    without = median_step(short_ids)
    with_long = median_step(short_ids + [f"r{num_short}"])
    return {"model": str(model_dir) if model_dir else "default", "dtype": dtype,
            "num_short": num_short, "short_len": short_len, "long_len": long_len,
            "step_ms_without_long": round(1e3 * without, 2),
            "step_ms_with_long": round(1e3 * with_long, 2),
            "ratio": round(with_long / without, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = step_costs(args.model, args.dtype)
    lines = [f"{key:>22}: {value}" for key, value in result.items()]
    print(json.dumps(result) if args.json else "\n".join(lines))


if __name__ == "__main__":
    main()
