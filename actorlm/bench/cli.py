"""``actorlm bench ...``: each benchmark's flags and the call that runs it (the results print
as lines, or as one JSON object with ``--json``)."""

from __future__ import annotations

import json
import sys

from actorlm.api.flags import add_engine_flags, engine_flags


def add_bench_commands(commands) -> None:
    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="bench",
                                                                           required=True)
    for add in (_add_bench_throughput, _add_bench_latency, _add_bench_structured,
                _add_bench_prefix, _add_bench_serve, _add_bench_embed):
        add(bench)


def _add_bench_throughput(bench) -> None:
    """``actorlm bench throughput``."""
    from actorlm.bench.lora import add_lora_arguments

    tp = bench.add_parser("throughput", help="offline throughput, optionally against transformers")
    add_engine_flags(tp)
    tp.add_argument("--num-prompts", type=int, required=True)
    tp.add_argument("--output-len", type=int, required=True)
    tp.add_argument("--compare", choices=["hf"], default=None)
    tp.add_argument("--num-iters", type=int, default=1, help="report medians over this many runs")
    tp.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    tp.add_argument("--trace", action="store_true",
                    help="record a trace (into a temporary file) while measuring")
    tp.add_argument("--profile", action="store_true",
                    help="report where the steps' time went (forward, sampling, engine)")
    add_lora_arguments(tp)
    tp.set_defaults(run=_bench_throughput)


def _add_bench_latency(bench) -> None:
    """``actorlm bench latency``."""
    from actorlm.bench.lora import add_lora_arguments

    lat = bench.add_parser("latency", help="one batch: time to first token, time per token")
    add_engine_flags(lat)
    lat.add_argument("--batch-size", type=int, default=1)
    lat.add_argument("--input-len", type=int, default=32)
    lat.add_argument("--output-len", type=int, default=128)
    lat.add_argument("--num-iters", type=int, default=3, help="report medians over this many runs")
    lat.add_argument("--compare", choices=["hf"], default=None)
    lat.add_argument("--workload", choices=["free", "grounded"], default="free",
                     help="free: chat prompts of --input-len tokens; grounded: a chat whose "
                          "last turn asks to repeat the model's answer of up to --input-len "
                          "tokens (where prompt lookup helps)")
    lat.add_argument("--profile", action="store_true",
                     help="report where the steps' time went (forward, sampling, engine)")
    lat.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    add_lora_arguments(lat)
    lat.set_defaults(run=_bench_latency)


def _add_bench_structured(bench) -> None:
    """``actorlm bench structured``."""
    so = bench.add_parser("structured", help="structured outputs against free text, one engine")
    add_engine_flags(so)
    so.add_argument("--num-prompts", type=int, default=32)
    so.add_argument("--output-len", type=int, default=128)
    so.add_argument("--num-iters", type=int, default=3, help="report medians over this many runs")
    so.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    so.set_defaults(run=_bench_structured)


def _add_bench_prefix(bench) -> None:
    """``actorlm bench prefix``."""
    from actorlm.bench.prefix import add_prefix_arguments, bench_prefix

    pf = bench.add_parser("prefix", help="prefix caching on against off: multi-turn chat and "
                          "a shared system prompt")
    add_prefix_arguments(pf)
    pf.set_defaults(run=bench_prefix)


def _add_bench_embed(bench) -> None:
    """``actorlm bench embed``."""
    from actorlm.bench.embed import add_embed_arguments

    em = bench.add_parser("embed", help="a pooling model's embeddings per second, optionally "
                          "against sentence-transformers")
    add_embed_arguments(em)
    em.set_defaults(run=_bench_embed)


def _bench_embed(args) -> int:
    from actorlm.bench.embed import run_embed

    result = run_embed(args.model, engine_flags(args), args.num_prompts, args.input_len,
                       args.num_iters, args.compare == "st", args.st_batch_size)
    return _report(result, args.json)


def _add_bench_serve(bench) -> None:
    """``actorlm bench serve``: vLLM's ``bench serve`` flags."""
    from actorlm.bench.datasets import add_dataset_arguments
    from actorlm.bench.serve import DEFAULT_PERCENTILE_METRICS

    bs = bench.add_parser("serve", help="online serving benchmark against a running server, "
                          "measured as vllm bench serve measures")
    bs.add_argument("--base-url", default="http://127.0.0.1:8000")
    bs.add_argument("--endpoint", default="/v1/completions",
                    choices=["/v1/completions", "/v1/chat/completions"])
    bs.add_argument("--model", default=None, help="model name to send (default: the server's)")
    bs.add_argument("--tokenizer", default=None,
                    help="the tokenizer the datasets measure prompts with (default: the one in "
                         "the directory the server serves)")
    bs.add_argument("--num-prompts", type=int, required=True)
    bs.add_argument("--request-rate", type=float, default=float("inf"),
                    help="requests per second, Poisson arrivals (default: inf, all at once)")
    bs.add_argument("--burstiness", type=float, default=1.0,
                    help="shape of the gamma-distributed gaps between arrivals: 1 is Poisson, "
                         "lower is burstier, higher more even")
    bs.add_argument("--max-tokens", type=int, default=None,
                    help="output tokens per request of the built-in prompts (default: 128); "
                         "a dataset sets its own")
    bs.add_argument("--max-concurrency", type=int, default=None)
    bs.add_argument("--seed", type=int, default=0, help="seeds the dataset and the arrivals")
    bs.add_argument("--ignore-eos", action="store_true",
                    help="every request decodes as many tokens as it asks for")
    add_dataset_arguments(bs)
    bs.add_argument("--percentile-metrics", default=",".join(DEFAULT_PERCENTILE_METRICS),
                    help="the metrics to report, comma-separated, of ttft, tpot, itl, e2el")
    bs.add_argument("--metric-percentiles", default="99",
                    help="the percentiles to report of each, comma-separated (e.g. 50,90,99)")
    bs.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                    help="service level objectives (ttft, tpot, e2el in milliseconds): "
                         "request_goodput counts the requests per second that meet them all")
    bs.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    bs.set_defaults(run=_bench_serve)


def _bench_throughput(args) -> int:
    from actorlm.bench.lora import bench_loras
    from actorlm.bench.throughput import run_throughput

    flags = engine_flags(args)
    result = run_throughput(args.model, flags, args.num_prompts, args.output_len,
                            compare_hf=args.compare == "hf", num_iters=args.num_iters,
                            trace=args.trace, profile=args.profile,
                            loras=bench_loras(args.lora_path, args.num_loras, flags))
    return _report(result, args.json)


def _bench_structured(args) -> int:
    from actorlm.bench.structured import run_structured

    result = run_structured(args.model, engine_flags(args), args.num_prompts, args.output_len,
                            args.num_iters)
    return _report(result, args.json)


def _bench_latency(args) -> int:
    from actorlm.bench.latency import run_latency
    from actorlm.bench.lora import bench_loras

    flags = engine_flags(args)
    result = run_latency(args.model, flags, args.batch_size, args.input_len,
                         args.output_len, num_iters=args.num_iters,
                         compare_hf=args.compare == "hf", profile=args.profile,
                         workload=args.workload,
                         loras=bench_loras(args.lora_path, args.num_loras, flags))
    return _report(result, args.json)


def _bench_serve(args) -> int:
    from actorlm.bench.datasets import DatasetOptions
    from actorlm.bench.serve import (parse_goodput, parse_metric_percentiles,
                                     parse_percentile_metrics, print_report, run_serve_benchmark)

    try:
        result = run_serve_benchmark(
            args.base_url, args.num_prompts, args.request_rate, endpoint=args.endpoint,
            max_tokens=args.max_tokens, model=args.model, max_concurrency=args.max_concurrency,
            seed=args.seed, ignore_eos=args.ignore_eos, dataset=DatasetOptions.from_args(args),
            tokenizer=args.tokenizer, burstiness=args.burstiness,
            percentile_metrics=parse_percentile_metrics(args.percentile_metrics),
            metric_percentiles=parse_metric_percentiles(args.metric_percentiles),
            goodput=parse_goodput(args.goodput))
    except RuntimeError as exc:  # the server refused the test request (an unknown --model...)
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result))
    else:
        print_report(result)
    return 0 if result["completed"] else 1


def _report(result: dict, as_json: bool) -> int:
    if as_json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>24}: {value}")
    return 0
