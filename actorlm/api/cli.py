"""The ``actorlm`` command: generate, bench throughput (serve and trace join later)."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from actorlm.api.flags import add_engine_flags, engine_flags


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="actorlm", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate completions for prompts")
    add_engine_flags(gen)
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")
    gen.set_defaults(run=_generate)

    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    tp = bench.add_parser("throughput", help="offline throughput, optionally against transformers")
    add_engine_flags(tp)
    tp.add_argument("--num-prompts", type=int, required=True)
    tp.add_argument("--output-len", type=int, required=True)
    tp.add_argument("--compare", choices=["hf"], default=None)
    tp.add_argument("--num-iters", type=int, default=1, help="report medians over this many runs")
    tp.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    tp.set_defaults(run=_bench_throughput)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args) or 0
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _generate(args) -> int:
    from actorlm.llm import LLM
    from actorlm.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    with LLM(args.model, **engine_flags(args)) as llm:
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params,
                               use_tqdm=False)
        else:
            outputs = llm.generate(args.prompts, params, use_tqdm=False)
    for prompt, output in zip(args.prompts, outputs):
        print(f"--- {prompt}\n{output.outputs[0].text}")
    return 0


def _bench_throughput(args) -> int:
    from actorlm.benchmark.throughput import run_throughput

    result = run_throughput(args.model, engine_flags(args), args.num_prompts, args.output_len,
                            compare_hf=args.compare == "hf", num_iters=args.num_iters)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>24}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
