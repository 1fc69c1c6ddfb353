"""The prompts ``actorlm bench serve`` sends: ``vllm bench serve``'s dataset kinds and flags.

- ``random``: prompts of random tokens, ``--random-input-len`` long (plus a shared
  ``--random-prefix-len`` prefix), asking for ``--random-output-len`` tokens; both lengths are
  drawn uniformly from ``[len * (1 - r), len * (1 + r)]`` with ``r = --random-range-ratio``.
- ``prefix_repetition``: ``--prefix-repetition-num-prefixes`` random prefixes, each shared by
  an equal share of the prompts, followed by a random suffix of its own (prefix caching's
  workload).
- ``sharegpt``: a ShareGPT JSON file; the first human turn is the prompt, the reply's length in
  tokens the output length (or ``--sharegpt-output-len``); too short and too long pairs are
  skipped with vLLM's limits.
- no ``--dataset-name``: the built-in chat prompts of ``bench throughput``, ``--max-tokens``
  each.

Random prompts are token ids decoded into text (what a client sends), re-encoded and adjusted
until the text holds the asked number of tokens, as vLLM's ``RandomDataset`` does. Everything
is drawn from ``--seed``: the same flags give the same prompts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math

import numpy as np

from actorlm.bench.throughput import bench_prompts

logger = logging.getLogger(__name__)

DATASET_NAMES = ("random", "prefix_repetition", "sharegpt")
BUILTIN_OUTPUT_LEN = 128
# vLLM's filter for ShareGPT pairs (``is_valid_sequence``), in tokens
SHAREGPT_MIN_LEN, SHAREGPT_MAX_PROMPT_LEN, SHAREGPT_MAX_TOTAL_LEN = 4, 1024, 2048
_MAX_FIT_TRIES = 10


@dataclasses.dataclass(frozen=True)
class SampleRequest:
    """One request to send: the prompt's text, its length in tokens (None where no tokenizer
    measured it: the built-in prompts) and the number of tokens to ask for."""

    prompt: str
    prompt_len: int | None
    expected_output_len: int


@dataclasses.dataclass(frozen=True)
class DatasetOptions:
    """The dataset flags, checked when built. Defaults are vLLM's."""

    name: str | None = None
    path: str | None = None
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    random_prefix_len: int = 0
    prefix_repetition_prefix_len: int = 256
    prefix_repetition_suffix_len: int = 256
    prefix_repetition_num_prefixes: int = 10
    prefix_repetition_output_len: int = 128
    sharegpt_output_len: int | None = None

    def __post_init__(self) -> None:
        if self.name is not None and self.name not in DATASET_NAMES:
            raise ValueError(f"--dataset-name must be one of {', '.join(DATASET_NAMES)}, "
                             f"got {self.name!r}")
        if self.name == "sharegpt" and self.path is None:
            raise ValueError("--dataset-name sharegpt needs --dataset-path FILE.json")
        if self.path is not None and self.name != "sharegpt":
            raise ValueError("--dataset-path is read by --dataset-name sharegpt only")
        if not 0.0 <= self.random_range_ratio < 1.0:
            raise ValueError(f"--random-range-ratio must be in [0, 1), "
                             f"got {self.random_range_ratio}")
        for flag, value, least in (
                ("--random-input-len", self.random_input_len, 0),
                ("--random-output-len", self.random_output_len, 1),
                ("--random-prefix-len", self.random_prefix_len, 0),
                ("--prefix-repetition-prefix-len", self.prefix_repetition_prefix_len, 0),
                ("--prefix-repetition-suffix-len", self.prefix_repetition_suffix_len, 0),
                ("--prefix-repetition-num-prefixes", self.prefix_repetition_num_prefixes, 1),
                ("--prefix-repetition-output-len", self.prefix_repetition_output_len, 1),
                ("--sharegpt-output-len", self.sharegpt_output_len, 1)):
            if value is not None and value < least:
                raise ValueError(f"{flag} must be at least {least}, got {value}")
        if self.prefix_repetition_prefix_len + self.prefix_repetition_suffix_len < 1:
            raise ValueError("--prefix-repetition-prefix-len plus --prefix-repetition-suffix-len "
                             "must be at least 1")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DatasetOptions:
        return cls(**{field.name: getattr(args, _ARG_NAMES.get(field.name, field.name))
                      for field in dataclasses.fields(cls)})

    @property
    def needs_tokenizer(self) -> bool:
        return self.name is not None


_ARG_NAMES = {"name": "dataset_name", "path": "dataset_path"}


def add_dataset_arguments(parser: argparse.ArgumentParser) -> None:
    """The dataset flags, named as ``vllm bench serve`` names them."""
    d = DatasetOptions()
    group = parser.add_argument_group("datasets (as vllm bench serve's)")
    group.add_argument("--dataset-name", choices=DATASET_NAMES, default=None,
                       help="the prompts to send (default: the built-in chat prompts, "
                            "--max-tokens each)")
    group.add_argument("--dataset-path", default=None, help="the ShareGPT JSON file")
    group.add_argument("--random-input-len", type=int, default=d.random_input_len)
    group.add_argument("--random-output-len", type=int, default=d.random_output_len)
    group.add_argument("--random-range-ratio", type=float, default=d.random_range_ratio,
                       help="lengths are drawn from [len * (1 - r), len * (1 + r)]")
    group.add_argument("--random-prefix-len", type=int, default=d.random_prefix_len,
                       help="random tokens every prompt starts with")
    group.add_argument("--prefix-repetition-prefix-len", type=int,
                       default=d.prefix_repetition_prefix_len)
    group.add_argument("--prefix-repetition-suffix-len", type=int,
                       default=d.prefix_repetition_suffix_len)
    group.add_argument("--prefix-repetition-num-prefixes", type=int,
                       default=d.prefix_repetition_num_prefixes)
    group.add_argument("--prefix-repetition-output-len", type=int,
                       default=d.prefix_repetition_output_len)
    group.add_argument("--sharegpt-output-len", type=int, default=None,
                       help="ask every request for this many tokens (default: the reply's)")


def load_tokenizer(name_or_path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name_or_path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"no tokenizer could be loaded from {name_or_path!r} ({exc}); pass "
                         f"--tokenizer with the served model's directory") from exc


def sample_requests(options: DatasetOptions, num_requests: int, tokenizer=None, seed: int = 0,
                    builtin_output_len: int = BUILTIN_OUTPUT_LEN) -> list[SampleRequest]:
    """``num_requests`` requests of the dataset ``options`` names (``tokenizer``: the served
    model's, needed by every named dataset)."""
    rng = np.random.default_rng(seed)
    if options.name is None:
        return [SampleRequest(c[0]["content"], None, builtin_output_len)
                for c in bench_prompts(num_requests)]
    if tokenizer is None:
        raise ValueError(f"--dataset-name {options.name} needs the served model's tokenizer")
    if options.name == "random":
        return random_requests(tokenizer, num_requests, options, rng)
    if options.name == "prefix_repetition":
        return prefix_repetition_requests(tokenizer, num_requests, options, rng)
    return sharegpt_requests(tokenizer, num_requests, options, rng)


def random_requests(tokenizer, num_requests: int, options: DatasetOptions,
                    rng: np.random.Generator) -> list[SampleRequest]:
    # the server adds the tokenizer's own special tokens (a BOS) to the text's: they count
    # towards the input length, as in vLLM
    body_len = max(0, options.random_input_len - tokenizer.num_special_tokens_to_add())
    input_low, input_high = _length_range(body_len, options.random_range_ratio)
    output_low, output_high = _length_range(options.random_output_len,
                                            options.random_range_ratio)
    output_low, output_high = max(output_low, 1), max(output_high, 1)
    if options.random_prefix_len + input_low < 1:
        raise ValueError("the shortest random prompt would be empty: raise --random-input-len "
                         "or --random-prefix-len, or lower --random-range-ratio")
    pool = token_pool(tokenizer)
    _, prefix_ids = _fit(tokenizer, _draw(pool, options.random_prefix_len, rng),
                         options.random_prefix_len, pool, rng)
    input_lens = rng.integers(input_low, input_high + 1, size=num_requests)
    output_lens = rng.integers(output_low, output_high + 1, size=num_requests)
    requests = []
    for input_len, output_len in zip(input_lens.tolist(), output_lens.tolist()):
        target = len(prefix_ids) + input_len
        text, ids = _fit(tokenizer, prefix_ids + _draw(pool, input_len, rng), target, pool, rng)
        requests.append(SampleRequest(text, len(ids), output_len))
    _report_mismatch(requests, [options.random_prefix_len + n for n in input_lens.tolist()])
    return requests


def prefix_repetition_requests(tokenizer, num_requests: int, options: DatasetOptions,
                               rng: np.random.Generator) -> list[SampleRequest]:
    num_prefixes = options.prefix_repetition_num_prefixes
    if num_requests < num_prefixes:
        raise ValueError(f"--num-prompts {num_requests} is fewer than "
                         f"--prefix-repetition-num-prefixes {num_prefixes}")
    pool = token_pool(tokenizer)
    prefix_len, suffix_len = (options.prefix_repetition_prefix_len,
                              options.prefix_repetition_suffix_len)
    prefixes = [_fit(tokenizer, _draw(pool, prefix_len, rng), prefix_len, pool, rng)[1]
                for _ in range(num_prefixes)]
    requests = []
    for i in range(num_requests):  # the prefixes take turns: every one has an equal share
        prefix_ids = prefixes[i % num_prefixes]
        text, ids = _fit(tokenizer, prefix_ids + _draw(pool, suffix_len, rng),
                         len(prefix_ids) + suffix_len, pool, rng)
        requests.append(SampleRequest(text, len(ids), options.prefix_repetition_output_len))
    _report_mismatch(requests, [prefix_len + suffix_len] * num_requests)
    # shuffled, as vLLM's: prompts that share a prefix do not arrive one after another
    return [requests[i] for i in rng.permutation(num_requests).tolist()]


def sharegpt_requests(tokenizer, num_requests: int, options: DatasetOptions,
                      rng: np.random.Generator) -> list[SampleRequest]:
    try:
        with open(options.path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--dataset-path {options.path}: {exc}") from exc
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {options.path}: a ShareGPT file holds a JSON list of "
                         f"{{\"conversations\": [...]}} entries")
    exchanges = [pair for pair in map(_first_exchange, data) if pair is not None]
    fixed_output_len = options.sharegpt_output_len
    requests = []
    for i in rng.permutation(len(exchanges)).tolist():
        if len(requests) == num_requests:
            break
        prompt, reply = exchanges[i]
        prompt_len = len(tokenizer(prompt).input_ids)
        output_len = len(tokenizer(reply).input_ids) if fixed_output_len is None \
            else fixed_output_len
        if _is_kept(prompt_len, output_len, check_output=fixed_output_len is None):
            requests.append(SampleRequest(prompt, prompt_len, output_len))
    if not requests:
        raise ValueError(f"--dataset-path {options.path}: no human turn with a reply fits "
                         f"{SHAREGPT_MIN_LEN}..{SHAREGPT_MAX_PROMPT_LEN} prompt tokens and "
                         f"{SHAREGPT_MAX_TOTAL_LEN} in all")
    if len(requests) < num_requests:  # vLLM oversamples too, rather than send fewer
        logger.info("%s holds %d usable conversations: %d are sent twice or more",
                    options.path, len(requests), num_requests - len(requests))
        picks = rng.integers(0, len(requests), size=num_requests - len(requests)).tolist()
        requests += [requests[i] for i in picks]
    return requests


def token_pool(tokenizer) -> np.ndarray:
    """The ids random prompts are drawn from: ordinary tokens whose text encodes back into
    that very token. Special tokens would change how the server reads a prompt, and a token
    that is part of a character (one byte of a byte-level vocabulary) decodes into U+FFFD,
    which encodes into other tokens: prompts of such tokens would not keep their length."""
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(tokenizer.vocab_size) if i not in special]
    texts = tokenizer.batch_decode([[i] for i in ids])
    encoded = tokenizer(texts, add_special_tokens=False).input_ids
    pool = np.array([i for i, again in zip(ids, encoded) if again == [i]], dtype=np.int64)
    if pool.size == 0:
        raise ValueError("the tokenizer has no token that encodes back into itself: "
                         "random prompts cannot be built (pass another --tokenizer)")
    return pool


def _length_range(length: int, ratio: float) -> tuple[int, int]:
    return math.floor(length * (1.0 - ratio)), math.ceil(length * (1.0 + ratio))


def _draw(pool: np.ndarray, count: int, rng: np.random.Generator) -> list[int]:
    return pool[rng.integers(0, len(pool), size=count)].tolist()


def _fit(tokenizer, ids: list[int], target: int, pool: np.ndarray,
         rng: np.random.Generator) -> tuple[str, list[int]]:
    """The text of ``ids`` and the tokens that text encodes into, ``target`` of them if a few
    tries get there: tokens side by side can merge or split once decoded and encoded again
    (vLLM's ``gen_prompt_decode_to_target_len``). A text too long is cut at the end, one too
    short gets more random tokens at the end, so a prefix stays as it is."""
    text = tokenizer.decode(ids)
    for _ in range(_MAX_FIT_TRIES):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == target:
            break
        ids = ids[:target] if len(ids) > target else ids + _draw(pool, target - len(ids), rng)
        text = tokenizer.decode(ids)
    else:
        ids = tokenizer.encode(text, add_special_tokens=False)
    return text, ids


def _report_mismatch(requests: list[SampleRequest], targets: list[int]) -> None:
    mismatch = sum(r.prompt_len - t for r, t in zip(requests, targets))
    if mismatch:
        logger.warning("the prompts hold %d tokens %s than asked: their text does not encode "
                       "back into exactly the tokens drawn", abs(mismatch),
                       "more" if mismatch > 0 else "fewer")


def _first_exchange(entry) -> tuple[str, str] | None:
    """The first human turn of a ShareGPT entry and the reply to it, if there is one."""
    turns = entry.get("conversations") if isinstance(entry, dict) else None
    if not isinstance(turns, list):
        return None
    for turn, reply in zip(turns, turns[1:]):
        if isinstance(turn, dict) and isinstance(reply, dict) and turn.get("from") == "human" \
                and isinstance(turn.get("value"), str) and isinstance(reply.get("value"), str):
            return turn["value"], reply["value"]
    return None


def _is_kept(prompt_len: int, output_len: int, check_output: bool) -> bool:
    too_short = prompt_len < SHAREGPT_MIN_LEN or (check_output and output_len < SHAREGPT_MIN_LEN)
    too_long = prompt_len > SHAREGPT_MAX_PROMPT_LEN or \
        prompt_len + output_len > SHAREGPT_MAX_TOTAL_LEN
    return not (too_short or too_long)
