"""The C++ CPU kernels against their torch twins on one decode step of SmolLM2.

    python benchmarks/cpu_kernels_ab.py [--rounds 5]

For each shape (dtype, requests, context), ``--rounds`` fresh processes with the kernels and as
many with ``ACTORLM_CPU_KERNELS=0`` take turns; each times the model's forward, the logits and
the greedy argmax of one decode step (median of 15 after 3 warm-ups). Prints one line per
shape: the medians and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

SHAPES = [("bfloat16", 64, 140), ("float32", 64, 140), ("bfloat16", 1, 100), ("float32", 1, 100)]


def one_step_ms(dtype: str, num_requests: int, context: int) -> float:
    """In this process: the median time of one decode step, in milliseconds."""
    import random

    import torch

    from actorlm.config import EngineConfig
    from actorlm.models.parts import load_model_parts

    blocks_each = -(-context // 16)
    loaded = load_model_parts(EngineConfig(
        dtype=dtype, num_kv_blocks=num_requests * blocks_each + 600, max_model_len=8192))
    runner = loaded.parts.make_runner(0)
    blocks = list(range(1, 1 + num_requests * blocks_each))
    random.Random(0).shuffle(blocks)  # scattered, as a busy pool's are
    block_ids = [blocks[b * blocks_each:(b + 1) * blocks_each] for b in range(num_requests)]

    def step():
        meta = runner.backend.attention_metadata([1] * num_requests, [context] * num_requests,
                                                 block_ids, 16)
        with torch.inference_mode():
            hidden = runner.model(torch.randint(0, 40_000, (num_requests,)),
                                  torch.full((num_requests,), context - 1), runner.kv_caches,
                                  [meta])  # one KV-cache group: SmolLM2's layers are all full
            runner.backend.argmax(runner.model.compute_logits(hidden))

    for _ in range(3):
        step()
    times = []
    for _ in range(15):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _in_child(shape, kernels: bool) -> float:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "ACTORLM_CPU_KERNELS": "1" if kernels else "0"}
    done = subprocess.run([sys.executable, __file__, "--one", *map(str, shape)], env=env,
                          capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--one", nargs=3, metavar=("DTYPE", "REQUESTS", "CONTEXT"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(one_step_ms(args.one[0], int(args.one[1]), int(args.one[2])))
        return
    for shape in SHAPES:
        on, off = [], []
        for _ in range(args.rounds):
            on.append(_in_child(shape, True))
            off.append(_in_child(shape, False))
        kernels, twins = statistics.median(on), statistics.median(off)
        print(f"{shape[0]}, {shape[1]} requests at context {shape[2]}: kernels {kernels:.1f} "
              f"ms, torch twins {twins:.1f} ms, ratio {twins / kernels:.2f}", flush=True)


if __name__ == "__main__":
    main()
