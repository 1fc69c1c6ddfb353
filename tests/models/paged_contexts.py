"""A paged KV cache and block tables for driving a model step by step, as a worker does."""

from __future__ import annotations

import torch
from greedy import TOP


class PagedContexts:
    """A freshly allocated paged cache and per-request block tables, as the worker keeps them:
    one table per KV-cache group (``num_groups``, the model's by default), each with blocks of
    its own."""

    def __init__(self, model, num_blocks=96, block_size=4, seed=0, num_groups=None,
                 cache_dtype=None):
        shape = (num_blocks, block_size, model.num_kv_heads, model.head_dim)
        cache_dtype = cache_dtype or model.dtype  # (an FP8 cache: --kv-cache-dtype)
        self.kv_caches = [(torch.zeros(shape, dtype=cache_dtype), torch.zeros(shape, dtype=cache_dtype))
                          for _ in range(model.num_layers)]
        self.block_size = block_size
        # Shuffled so a request's blocks are not contiguous; block 0 is the table padding.
        self.pool = (torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed)) + 1).tolist()
        num_groups = num_groups or len(model.kv_cache_groups)
        self.tables: list[dict[int, list[int]]] = [{} for _ in range(num_groups)]  # rid -> ids
        self.lens: dict[int, int] = {}
        self.prompt_lens: dict[int, int] = {}  # rid -> its prompt's length, where it matters

    def step(self, model, chunks: list[tuple[int, list[int]]]) -> torch.Tensor:
        """Run one flattened step of (request id, new token ids) chunks; returns logits [T, V]."""
        ids, positions, q_lens, seq_lens = [], [], [], []
        for rid, tokens in chunks:
            start = self.lens.get(rid, 0)
            end = start + len(tokens)
            for tables in self.tables:
                blocks = tables.setdefault(rid, [])
                while len(blocks) * self.block_size < end:
                    blocks.append(self.pool.pop())
            ids += tokens
            positions += model.rope_rows(start, end, self.prompt_lens.get(rid, end))
            q_lens.append(len(tokens))
            seq_lens.append(end)
            self.lens[rid] = end
        metas = [model.backend.attention_metadata(q_lens, seq_lens,
                                                  [tables[rid] for rid, _ in chunks],
                                                  self.block_size) for tables in self.tables]
        with torch.inference_mode():
            hidden = model(torch.tensor(ids), torch.tensor(positions), self.kv_caches, metas)
            return model.compute_logits(hidden)


def random_prompt(vocab_size: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(7)
    return torch.randint(3, vocab_size, (length,), generator=generator).tolist()


def greedy_with_logits(model, prompt, num_tokens, block_size, num_blocks=256):
    """The model's logits at every position (the prompt prefilled in two chunks, then one
    token a step), its greedy tokens and each step's top ``TOP``."""
    cache = PagedContexts(model, num_blocks=num_blocks, block_size=block_size)
    cache.prompt_lens[0] = len(prompt)
    cut = len(prompt) // 2 + 3
    logits = [cache.step(model, [(0, prompt[:cut])]), cache.step(model, [(0, prompt[cut:])])]
    tokens, tops = [], []
    for i in range(num_tokens):
        last = logits[-1][-1]
        tokens.append(int(last.argmax()))
        tops.append(set(last.topk(TOP).indices.tolist()))
        if i + 1 < num_tokens:
            logits.append(cache.step(model, [(0, tokens[-1:])]))
    return torch.cat(logits), tokens, tops
