"""``actorlm bench serve``: vLLM's datasets and figures, and runs against the test server."""

from __future__ import annotations

import json
import math
import os

import pytest

from actorlm.api.cli import main
from actorlm.bench.datasets import (DatasetOptions, load_tokenizer, sample_requests,
                                    token_pool)
from actorlm.bench.serve import (RequestOutcome, arrival_times, compute_metrics,
                                 parse_goodput, parse_metric_percentiles)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return load_tokenizer(str(tiny_llama_dir))


def _run_json(capsys, *flags: str) -> dict:
    assert main(["bench", "serve", *flags, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _tokens(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


# --- datasets ----------------------------------------------------------------------------------

def test_random_prompts_hold_the_asked_lengths(tokenizer):
    options = DatasetOptions(name="random", random_input_len=20, random_output_len=6)
    requests = sample_requests(options, 12, tokenizer, seed=3)
    assert [r.prompt_len for r in requests] == [20] * 12
    assert [len(_tokens(tokenizer, r.prompt)) for r in requests] == [20] * 12
    assert [r.expected_output_len for r in requests] == [6] * 12
    assert len({r.prompt for r in requests}) == 12


def test_random_lengths_spread_over_the_range_ratio(tokenizer):
    options = DatasetOptions(name="random", random_input_len=20, random_output_len=8,
                             random_range_ratio=0.5)
    requests = sample_requests(options, 40, tokenizer, seed=0)
    input_lens = [r.prompt_len for r in requests]
    output_lens = [r.expected_output_len for r in requests]
    assert all(10 <= n <= 30 for n in input_lens) and len(set(input_lens)) > 5
    assert all(4 <= n <= 12 for n in output_lens) and len(set(output_lens)) > 3
    assert input_lens == [len(_tokens(tokenizer, r.prompt)) for r in requests]


def test_random_prompts_are_repeatable_from_the_seed(tokenizer):
    options = DatasetOptions(name="random", random_input_len=16, random_range_ratio=0.3)
    first = sample_requests(options, 6, tokenizer, seed=1)
    assert sample_requests(options, 6, tokenizer, seed=1) == first
    assert sample_requests(options, 6, tokenizer, seed=2) != first


def test_random_prefix_is_shared_by_every_prompt(tokenizer):
    options = DatasetOptions(name="random", random_input_len=10, random_prefix_len=12)
    requests = sample_requests(options, 8, tokenizer, seed=0)
    token_lists = [_tokens(tokenizer, r.prompt) for r in requests]
    assert all(len(t) == 22 for t in token_lists)
    assert len({tuple(t[:11]) for t in token_lists}) == 1  # the seam may merge the 12th
    assert len({tuple(t[12:]) for t in token_lists}) == 8


def test_random_prompts_draw_no_special_token(tokenizer):
    pool = set(token_pool(tokenizer).tolist())
    assert pool and not pool & set(tokenizer.all_special_ids)
    assert all(_tokens(tokenizer, tokenizer.decode([i])) == [i] for i in pool)


def test_prefix_repetition_shares_each_prefix_among_its_prompts(tokenizer):
    options = DatasetOptions(name="prefix_repetition", prefix_repetition_prefix_len=16,
                             prefix_repetition_suffix_len=8, prefix_repetition_num_prefixes=3,
                             prefix_repetition_output_len=5)
    requests = sample_requests(options, 9, tokenizer, seed=0)
    token_lists = [_tokens(tokenizer, r.prompt) for r in requests]
    assert [r.prompt_len for r in requests] == [24] * 9
    assert [len(t) for t in token_lists] == [24] * 9
    assert [r.expected_output_len for r in requests] == [5] * 9
    groups: dict[tuple, int] = {}
    for t in token_lists:
        groups[tuple(t[:15])] = groups.get(tuple(t[:15]), 0) + 1
    assert sorted(groups.values()) == [3, 3, 3]
    assert len({r.prompt for r in requests}) == 9
    # shuffled: the prompts of one prefix do not come one after another
    assert [tuple(t[:15]) for t in token_lists[:3]] != [tuple(token_lists[0][:15])] * 3


def test_prefix_repetition_needs_a_prompt_per_prefix(tokenizer):
    options = DatasetOptions(name="prefix_repetition", prefix_repetition_num_prefixes=4)
    with pytest.raises(ValueError, match="--prefix-repetition-num-prefixes"):
        sample_requests(options, 3, tokenizer)


def _sharegpt_file(tmp_path, tokenizer) -> tuple[str, str, str]:
    question = "Tell me a story about the old baker and the village."
    answer = "Once upon a time there was a small village at the edge of a great forest."
    long_prompt = "the quick brown fox " * 400  # over 1024 tokens: skipped
    entries = [
        {"id": "a", "conversations": [{"from": "human", "value": question},
                                      {"from": "gpt", "value": answer}]},
        {"id": "b", "conversations": [{"from": "human", "value": "one turn only"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "Hi"},
                                      {"from": "gpt", "value": answer}]},  # prompt too short
        {"id": "d", "conversations": [{"from": "human", "value": long_prompt},
                                      {"from": "gpt", "value": answer}]},
        {"id": "e", "conversations": [{"from": "system", "value": "be brief"},
                                      {"from": "human", "value": answer},
                                      {"from": "gpt", "value": question}]},
        {"id": "f", "conversations": [{"from": "human", "value": question},
                                      {"from": "gpt", "value": "Ok."}]},  # reply too short
    ]
    assert len(tokenizer("Hi").input_ids) < 4 and len(tokenizer("Ok.").input_ids) < 4
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(entries))
    return str(path), question, answer


def test_sharegpt_takes_the_first_human_turn_and_its_reply_length(tmp_path, tokenizer):
    path, question, answer = _sharegpt_file(tmp_path, tokenizer)
    requests = sample_requests(DatasetOptions(name="sharegpt", path=path), 2, tokenizer)
    by_prompt = {r.prompt: r for r in requests}
    assert set(by_prompt) == {question, answer}
    for prompt, reply in ((question, answer), (answer, question)):
        assert by_prompt[prompt].prompt_len == len(tokenizer(prompt).input_ids)
        assert by_prompt[prompt].expected_output_len == len(tokenizer(reply).input_ids)


def test_sharegpt_output_len_overrides_and_keeps_short_replies(tmp_path, tokenizer):
    path, question, answer = _sharegpt_file(tmp_path, tokenizer)
    options = DatasetOptions(name="sharegpt", path=path, sharegpt_output_len=7)
    requests = sample_requests(options, 3, tokenizer)
    assert sorted(r.prompt for r in requests) == sorted([question, question, answer])
    assert {r.expected_output_len for r in requests} == {7}


def test_sharegpt_repeats_conversations_when_the_file_holds_too_few(tmp_path, tokenizer):
    path, question, answer = _sharegpt_file(tmp_path, tokenizer)
    requests = sample_requests(DatasetOptions(name="sharegpt", path=path), 5, tokenizer)
    assert len(requests) == 5 and {r.prompt for r in requests} == {question, answer}


def test_no_dataset_named_sends_the_builtin_chat_prompts():
    requests = sample_requests(DatasetOptions(), 3, builtin_output_len=9)
    assert [r.expected_output_len for r in requests] == [9, 9, 9]
    assert requests[0].prompt == "Write a short story about a lighthouse."


@pytest.mark.parametrize("kwargs, flag", [
    (dict(name="sharegpt"), "--dataset-path"),
    (dict(path="x.json"), "--dataset-path"),
    (dict(name="random", random_range_ratio=1.0), "--random-range-ratio"),
    (dict(name="random", random_output_len=0), "--random-output-len"),
    (dict(sharegpt_output_len=0), "--sharegpt-output-len"),
    (dict(prefix_repetition_num_prefixes=0), "--prefix-repetition-num-prefixes"),
])
def test_bad_dataset_flags_name_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        DatasetOptions(**kwargs)


def test_bad_flags_exit_with_a_message_before_any_request(capsys):
    for flags in (["--dataset-name", "sharegpt"], ["--goodput", "ttft"],
                  ["--goodput", "itl:5"], ["--percentile-metrics", "ttft,latency"],
                  ["--metric-percentiles", "101"],
                  ["--dataset-name", "random", "--max-tokens", "8"]):
        # nothing listens there: a flag that passed would fail on the connection instead
        assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts",
                     "2", *flags]) == 2, flags
        assert capsys.readouterr().err.startswith("error: --"), flags


def test_a_base_url_where_no_server_answers_is_an_error_naming_it(capsys):
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "2"]) == 2
    assert capsys.readouterr().err.startswith("error: --base-url http://127.0.0.1:9: no ")


# --- figures -----------------------------------------------------------------------------------

def _outcome(ttft: float, gaps: list[float], output_tokens: int, prompt_tokens: int = 10):
    return RequestOutcome(ok=True, prompt_tokens=prompt_tokens, output_tokens=output_tokens,
                          ttft=ttft, itl=gaps, latency=ttft + sum(gaps))


def test_figures_follow_vllms_definitions():
    outcomes = [_outcome(0.1, [0.02, 0.04], 3), _outcome(0.3, [0.01] * 4, 5),
                _outcome(0.2, [], 1), RequestOutcome(error="HTTP 500: boom", prompt_tokens=7)]
    result = compute_metrics(outcomes, 2.0, ("ttft", "tpot", "itl", "e2el"), (50.0, 99.9),
                             {"ttft": 250.0})
    assert result["completed"] == 3 and result["failed"] == 1
    assert result["total_input_tokens"] == 30 and result["total_output_tokens"] == 9
    assert result["output_lens"] == [3, 5, 1, 0] and result["input_lens"] == [10, 10, 10, 7]
    assert result["request_throughput"] == 3 / 2.0
    assert result["output_throughput"] == result["total_output_tokens"] / result["duration"]
    assert result["total_token_throughput"] == 39 / 2.0
    # TPOT leaves out the one-token request; (E2EL - TTFT) / (tokens - 1) per request
    assert result["mean_tpot_ms"] == pytest.approx(1000 * (0.03 + 0.01) / 2)
    assert result["mean_itl_ms"] == pytest.approx(1000 * 0.10 / 6)
    assert result["median_ttft_ms"] == pytest.approx(200.0)
    assert result["std_ttft_ms"] == pytest.approx(1000 * math.sqrt(2 / 3 * 0.01))
    assert result["p50_e2el_ms"] == pytest.approx(result["median_e2el_ms"])
    assert result["median_ttft_ms"] <= result["p99.9_ttft_ms"] <= 300.0
    assert result["request_goodput"] == 2 / 2.0  # TTFT 0.3 s misses the 250 ms objective
    assert result["errors"] == ["HTTP 500: boom"]


def test_goodput_is_at_most_throughput_and_zero_for_an_impossible_objective():
    outcomes = [_outcome(0.1 * i, [0.05] * i, i + 1) for i in range(1, 6)]
    every = compute_metrics(outcomes, 3.0, goodput={"e2el": 1e9, "tpot": 1e9})
    assert every["request_goodput"] == every["request_throughput"]
    some = compute_metrics(outcomes, 3.0, goodput={"ttft": 250.0, "tpot": 60.0})
    assert 0 < some["request_goodput"] < some["request_throughput"]
    assert compute_metrics(outcomes, 3.0, goodput={"ttft": 0.0})["request_goodput"] == 0
    assert compute_metrics(outcomes, 3.0)["request_goodput"] is None


def test_default_percentiles_are_vllms():
    result = compute_metrics([_outcome(0.1, [0.02], 2)], 1.0)
    for metric in ("ttft", "tpot", "itl"):
        assert {f"{s}_{metric}_ms" for s in ("mean", "median", "std", "p99")} <= set(result)
    assert not any("e2el" in key or "p90" in key for key in result)


def test_goodput_and_percentile_flags_parse():
    assert parse_goodput(["ttft:500", "tpot:12.5", "e2el:0"]) == \
        {"ttft": 500.0, "tpot": 12.5, "e2el": 0.0}
    assert parse_goodput(None) == {}
    assert parse_metric_percentiles("50,90,99.9") == (50.0, 90.0, 99.9)
    for bad in (["ttft=5"], ["ttft:-1"], ["itl:5"], ["ttft:soon"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)


def test_arrivals_follow_the_rate_and_the_seed():
    assert arrival_times(4, float("inf")) == [0.0] * 4
    times = arrival_times(50, 10.0, seed=0)
    assert all(a < b for a, b in zip(times, times[1:]))
    assert times[-1] == pytest.approx(5.0)  # scaled: the last arrives at N / rate
    assert arrival_times(50, 10.0, seed=0) == times and arrival_times(50, 10.0, seed=1) != times
    assert arrival_times(4, 2.0, burstiness=float("inf")) == pytest.approx([0.5, 1.0, 1.5, 2.0])
    gaps = [b - a for a, b in zip(times, times[1:])]
    even = arrival_times(50, 10.0, burstiness=50.0, seed=0)
    even_gaps = [b - a for a, b in zip(even, even[1:])]
    assert max(even_gaps) - min(even_gaps) < max(gaps) - min(gaps)


# --- against the test server -------------------------------------------------------------------

@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_bench_serve_json(server, capsys, endpoint):
    result = _run_json(capsys, "--base-url", server, "--endpoint", endpoint,
                       "--num-prompts", "12", "--request-rate", "40", "--max-tokens", "8",
                       "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el",
                       "--metric-percentiles", "90,99")
    assert result["completed"] == 12 and result["failed"] == 0
    assert result["total_output_tokens"] == 12 * 8 and result["output_lens"] == [8] * 12
    assert result["total_input_tokens"] > 0 and result["request_throughput"] > 0
    assert result["dataset_name"] == "builtin" and result["max_tokens"] == 8
    for metric in ("ttft", "tpot", "itl", "e2el"):
        values = [result[f"{stat}_{metric}_ms"] for stat in ("mean", "median", "std", "p90",
                                                             "p99")]
        assert all(v >= 0 for v in values), (metric, values)
        assert result[f"median_{metric}_ms"] <= result[f"p99_{metric}_ms"]
    assert result["mean_ttft_ms"] < result["mean_e2el_ms"]


@pytest.mark.parametrize("dataset_flags", [
    ["--dataset-name", "random", "--random-input-len", "24", "--random-output-len", "6",
     "--random-range-ratio", "0.5", "--random-prefix-len", "4"],
    ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "16",
     "--prefix-repetition-suffix-len", "8", "--prefix-repetition-num-prefixes", "2",
     "--prefix-repetition-output-len", "5"],
], ids=["random", "prefix_repetition"])
def test_bench_serve_dataset_gets_the_asked_lengths(server, capsys, tiny_llama_dir,
                                                    tokenizer, dataset_flags):
    # the client loads the tokenizer from the directory the server says it serves
    result = _run_json(capsys, "--base-url", server, "--num-prompts", "6", "--seed", "5",
                       "--ignore-eos", "--goodput", "ttft:0", *dataset_flags)
    args = dict(zip(dataset_flags[::2], dataset_flags[1::2]))
    options = DatasetOptions(name=args.pop("--dataset-name"), **{
        flag.removeprefix("--").replace("-", "_"): float(v) if "ratio" in flag else int(v)
        for flag, v in args.items()})
    requests = sample_requests(options, 6, tokenizer, seed=5)
    assert result["completed"] == 6 and result["dataset_name"] == options.name
    assert result["output_lens"] == [r.expected_output_len for r in requests]
    assert result["input_lens"] == [r.prompt_len for r in requests]  # as the server counted
    assert result["total_output_tokens"] == sum(r.expected_output_len for r in requests)
    assert result["output_throughput"] == result["total_output_tokens"] / result["duration"]
    assert result["request_goodput"] == 0  # no first token comes in 0 ms


def test_bench_serve_sharegpt_with_a_given_tokenizer(server, capsys, tmp_path, tokenizer,
                                                     tiny_llama_dir):
    path, _, _ = _sharegpt_file(tmp_path, tokenizer)
    result = _run_json(capsys, "--base-url", server, "--num-prompts", "3", "--dataset-name",
                       "sharegpt", "--dataset-path", path, "--sharegpt-output-len", "4",
                       "--ignore-eos", "--tokenizer", os.fspath(tiny_llama_dir),
                       "--goodput", "e2el:600000")
    assert result["completed"] == 3 and result["output_lens"] == [4, 4, 4]
    assert result["request_goodput"] == result["request_throughput"]


def test_bench_serve_table(server, capsys):
    assert main(["bench", "serve", "--base-url", server, "--num-prompts", "4",
                 "--max-tokens", "4", "--max-concurrency", "2", "--goodput", "ttft:60000"]) == 0
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "Mean TTFT (ms)" in out and "P99 ITL (ms)" in out
    assert "Request goodput (req/s)" in out and "Maximum request concurrency:" in out
    assert "E2EL" not in out  # not among vLLM's default --percentile-metrics


def test_bench_serve_of_a_model_the_server_lacks_says_what_the_server_answered(server, capsys):
    assert main(["bench", "serve", "--base-url", server, "--model", "nope",
                 "--num-prompts", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: the test request to ") and "HTTP 404" in err, err
