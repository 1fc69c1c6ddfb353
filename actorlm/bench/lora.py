"""LoRA adapters in the offline benchmarks (``bench throughput``, ``bench latency``), with
vLLM's ``benchmark_throughput`` options: ``--lora-path`` (here one directory or several) and
the engine's ``--enable-lora --max-loras --max-lora-rank``, plus ``--num-loras``, how many
distinct adapters the requests are spread over.

vLLM draws each request's adapter at random among ``--max-loras`` ids of one directory; here
request i runs adapter ``i % num_loras`` (ids 1..num_loras, each on the directories in turn),
so every run and every machine spreads the batch the same way. A run with adapters takes turns
with a run of the same prompts without any, in the same engine: the ratio of each pair is what
the adapters cost, measured a few seconds apart on a machine whose speed drifts.
"""

from __future__ import annotations

import argparse

from actorlm.lora_request import LoRARequest


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lora-path", nargs="+", default=None, metavar="DIR",
                        help="PEFT adapter directories (needs --enable-lora): the requests run "
                             "with --num-loras adapters over them, taking turns with a run "
                             "without adapters")
    parser.add_argument("--num-loras", type=int, default=None,
                        help="distinct adapters the requests are spread over, request i on "
                             "adapter i mod N (default: one per --lora-path)")


def bench_loras(lora_paths: list[str] | None, num_loras: int | None,
                flags: dict) -> list[LoRARequest] | None:
    """The adapters of a run (adapter k on ``lora_paths[k % len]``), or None without
    ``--lora-path``; a setting that cannot work is a ValueError naming its flag."""
    if not lora_paths:
        if num_loras is not None:
            raise ValueError("--num-loras needs --lora-path")
        return None
    if not flags.get("enable_lora"):
        raise ValueError("--lora-path needs --enable-lora")
    num_loras = len(lora_paths) if num_loras is None else num_loras
    if num_loras < 1:
        raise ValueError(f"--num-loras must be at least 1, got {num_loras}")
    return [LoRARequest(f"lora-{k + 1}", k + 1, str(lora_paths[k % len(lora_paths)]))
            for k in range(num_loras)]


def spread(loras: list[LoRARequest], num_requests: int) -> list[LoRARequest]:
    """Request i's adapter: ``loras[i % len(loras)]``."""
    return [loras[i % len(loras)] for i in range(num_requests)]


def lora_fields(loras: list[LoRARequest], config) -> dict:
    """What the result says about the adapters it ran with (``config``: the engine's)."""
    return {"num_loras": len(loras), "max_loras": config.max_loras,
            "max_lora_rank": config.max_lora_rank,
            "lora_paths": sorted({lora.lora_path for lora in loras})}
