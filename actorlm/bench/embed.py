"""``actorlm bench embed``: a pooling model's embeddings per second, and against
sentence-transformers on the same directory (``--compare st``).

Prompts: ``num_prompts`` distinct texts of about ``input_len`` tokens (the bench's topics, each
prompt numbered, cut to length). Each round embeds all of them once in this engine
(``LLM.embed``, its prefix cache emptied first: a round must not find the last one's prompts)
and, with ``--compare st``, once in sentence-transformers (``encode`` at ``--st-batch-size``, in
the dtype the engine runs); the two take turns, in one process, after a warm-up of each. Per
side: the medians over ``num_iters`` rounds of prompts/s and prompt tokens/s; the per-round
ratio; and how far the two sides' vectors are apart (the largest cosine distance).
"""

from __future__ import annotations

import argparse
import statistics
import time

from actorlm.bench.throughput import bench_prompts


def add_embed_arguments(parser: argparse.ArgumentParser) -> None:
    from actorlm.api.flags import add_engine_flags

    add_engine_flags(parser)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128, help="tokens a prompt is cut to")
    parser.add_argument("--num-iters", type=int, default=3,
                        help="report medians over this many runs")
    parser.add_argument("--compare", choices=["st"], default=None,
                        help="st: sentence-transformers on the same directory")
    parser.add_argument("--st-batch-size", type=int, default=32)
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object on the last line")


def embed_texts(tokenizer, num_prompts: int, input_len: int) -> list[str]:
    """Distinct texts of about ``input_len`` tokens each."""
    topics = " ".join(c[0]["content"] for c in bench_prompts(64))
    ids = tokenizer.encode(topics, add_special_tokens=False)
    while len(ids) < input_len:
        ids += ids
    texts = []
    for i in range(num_prompts):
        start = (i * 7) % max(1, len(ids) - input_len)
        texts.append(f"{i}. " + tokenizer.decode(ids[start:start + input_len - 4]))
    return texts


def run_embed(model: str | None, flags: dict, num_prompts: int, input_len: int,
              num_iters: int, compare_st: bool, st_batch_size: int) -> dict:
    import torch

    from actorlm.llm import LLM

    if min(num_prompts, input_len, num_iters, st_batch_size) < 1:
        raise ValueError("--num-prompts, --input-len, --num-iters and --st-batch-size must be "
                         "at least 1")
    llm = LLM(model, **{**flags, "runner": flags.get("runner", "pooling")})
    texts = embed_texts(llm.tokenizer, num_prompts, input_len)
    st = None
    if compare_st:
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(model, device="cpu").to(llm.config.torch_dtype())
    llm.embed(texts[:8], use_tqdm=False)  # warm-up: first calls, kernels built
    if st is not None:
        st.encode(texts[:8], batch_size=st_batch_size)
    ours, theirs, ratios, num_tokens, distance = [], [], [], 0, None
    for _ in range(num_iters):
        llm.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.embed(texts, use_tqdm=False)
        ours.append(time.perf_counter() - start)
        num_tokens = sum(len(o.prompt_token_ids) for o in outputs)
        if st is None:
            continue
        start = time.perf_counter()
        want = st.encode(texts, batch_size=st_batch_size, convert_to_tensor=True)
        theirs.append(time.perf_counter() - start)
        ratios.append(theirs[-1] / ours[-1])
        got = torch.tensor([o.outputs.embedding for o in outputs])
        cosine = torch.nn.functional.cosine_similarity(got, want.float().cpu())
        distance = float((1 - cosine).max())
    llm.shutdown()
    result = {"num_prompts": num_prompts, "mean_prompt_tokens": num_tokens / num_prompts,
              "dtype": str(llm.config.torch_dtype()).removeprefix("torch."),
              "prompts_per_s": num_prompts / statistics.median(ours),
              "tokens_per_s": num_tokens / statistics.median(ours),
              "seconds": ours}
    if st is not None:
        result.update({"st_prompts_per_s": num_prompts / statistics.median(theirs),
                       "st_seconds": theirs, "ratio_rounds": ratios,
                       "ratio_vs_st": statistics.median(ratios),
                       "max_cosine_distance_vs_st": distance})
    return result
