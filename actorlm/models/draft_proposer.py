"""A draft model proposes: a smaller model with the target's vocabulary guesses the next k
tokens greedily, and the target verifies them in one step (vLLM's ``draft_model`` method).

It runs on rank 0's worker after sampling, beside the target, with a paged KV cache of its
own: one (k, v) pair per layer, ``num_blocks`` blocks that it hands out itself (the engine's
allocator never sees them: no other actor holds them, and a request's drafts are only ever a
guess). Per request it keeps a block table and what its KV holds:

- positions below ``valid`` hold the KV of the request's own tokens;
- the next ``len(speculated)`` positions hold the KV of the drafts it fed itself last time
  (all but its last draft, which it proposed and never fed). The target accepts a prefix of
  them, so the next call keeps as many as the request's tokens confirm, and recomputes from
  the first that differs.

Each call is then one forward over every request's unconfirmed tokens (the whole prompt, for
a new one; the bonus token and a rejected draft's correction, usually), whose last rows give
the first drafts, then k - 1 one-token forwards for the others: a decode step of the draft,
which a CPU runs in one call. A request that would not fit (the pool is full, or its next
positions pass the draft's context) gets no drafts this time; it loses speed, never tokens,
since the rejection sampler keeps the target's distribution whatever is proposed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from actorlm.kernels import KernelBackend


@dataclass
class _DraftState:
    block_ids: list[int] = field(default_factory=list)
    valid: int = 0  # positions whose KV holds the request's own tokens
    speculated: list[int] = field(default_factory=list)  # drafts fed at valid, valid + 1, ...


class DraftModelProposer:
    def __init__(self, model, backend: KernelBackend, num_speculative_tokens: int,
                 block_size: int, dtype: torch.dtype, device: torch.device,
                 kv_cache_dtype: torch.dtype | None = None):
        self.model, self.backend, self.k = model, backend, num_speculative_tokens
        self.block_size, self.dtype, self.device = block_size, dtype, device
        self.kv_cache_dtype = kv_cache_dtype or dtype  # the target's (--kv-cache-dtype)
        self.max_positions = getattr(model.config, "max_position_embeddings", None) or 2048
        self.num_groups = len(getattr(model, "kv_cache_groups", None) or [None])
        self.states: dict[str, _DraftState] = {}
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.free_block_ids: list[int] = []  # none until the runner sizes the pool

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """A zeroed pool of ``num_blocks`` blocks (as many as the target's, which the runner
        passes on); every request starts again."""
        self.kv_caches = []  # (the old pool goes before the new one is made)
        shape = (num_blocks, self.block_size, self.model.num_kv_heads, self.model.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device),
                           torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device))
                          for _ in range(self.model.num_layers)]  # [num_blocks, bs, Hkv, D]
        self.free_block_ids = list(range(num_blocks - 1, -1, -1))
        self.states.clear()

    def forget(self, request_id: str) -> None:
        """The request finished or was preempted: its blocks go back to the pool."""
        state = self.states.pop(request_id, None)
        if state is not None:
            self.free_block_ids += state.block_ids

    @torch.inference_mode()
    def propose_all(self, request_ids: list[str], token_ids: list[list[int]]) -> list[list[int]]:
        """Up to k greedy drafts to follow each request's tokens (prompt + output)."""
        drafts: list[list[int]] = [[] for _ in request_ids]
        chosen, starts = [], []  # the requests that get drafts, and where each forward starts
        for i, (request_id, tokens) in enumerate(zip(request_ids, token_ids)):
            state = self.states.setdefault(request_id, _DraftState())
            start = self._confirm(state, tokens)
            if self._reserve(state, len(tokens) + self.k - 1):
                chosen.append(i)
                starts.append(start)
        if not chosen:
            return drafts
        lengths = [len(token_ids[i]) for i in chosen]
        tables = [self.states[request_ids[i]].block_ids for i in chosen]
        # one forward over each request's unconfirmed tokens (its last row gives draft 1),
        # then one token a request for drafts 2..k
        proposed = [self._forward([token_ids[i][start:] for i, start in zip(chosen, starts)],
                                  starts, tables)]
        for _ in range(1, self.k):
            proposed.append(self._forward([[t] for t in proposed[-1]], lengths, tables))
            lengths = [n + 1 for n in lengths]
        for row, (i, n) in enumerate(zip(chosen, lengths)):
            drafts[i] = [column[row] for column in proposed]
            state = self.states[request_ids[i]]
            state.valid, state.speculated = n - self.k + 1, drafts[i][:-1]
        return drafts

    def _confirm(self, state: _DraftState, tokens: list[int]) -> int:
        """Keep the KV of the drafts the request's tokens confirm; the first position to
        compute (at most the last token's: its logits give the first draft)."""
        for draft in state.speculated:
            if state.valid >= len(tokens) or tokens[state.valid] != draft:
                break
            state.valid += 1
        state.speculated = []
        state.valid = min(state.valid, len(tokens) - 1)
        return state.valid

    def _reserve(self, state: _DraftState, num_positions: int) -> bool:
        """Blocks for ``num_positions`` positions, if the pool and the context have room."""
        if num_positions > self.max_positions:
            return False
        missing = -(-num_positions // self.block_size) - len(state.block_ids)
        if missing > len(self.free_block_ids):
            return False
        for _ in range(max(0, missing)):
            state.block_ids.append(self.free_block_ids.pop())
        return True

    def _forward(self, inputs: list[list[int]], starts: list[int],
                 tables: list[list[int]]) -> list[int]:
        """Feed each request its ``inputs`` from position ``starts``; the draft's greedy token
        after each request's last one. A few tokens attend as one decode row each (every row
        sees its context up to itself), so that the forward is a decode step, which a CPU
        runs in one call; a prompt attends as one chunk."""
        q_lens, seq_lens, row_tables, last_rows = [], [], [], []
        for tokens, start, table in zip(inputs, starts, tables):
            end = start + len(tokens)
            if len(tokens) <= self.k + 1:
                q_lens += [1] * len(tokens)
                seq_lens += range(start + 1, end + 1)
                row_tables += [table] * len(tokens)
            else:
                q_lens.append(len(tokens))
                seq_lens.append(end)
                row_tables.append(table)
            last_rows.append(end - start + (last_rows[-1] + 1 if last_rows else 0) - 1)
        meta = self.backend.attention_metadata(q_lens, seq_lens, row_tables, self.block_size)
        dev = self.device
        input_ids = torch.tensor([t for tokens in inputs for t in tokens], device=dev)
        # (LongRoPE: each position by its own side of the original context, the prompt's
        # length unknown here; a draft only proposes)
        positions = torch.tensor([p for tokens, start in zip(inputs, starts)
                                  for p in self.model.rope_rows(start, start + len(tokens), 0)],
                                 device=dev)
        hidden = self.model(input_ids, positions, self.kv_caches,
                            [meta] * self.num_groups)  # [T, hidden]
        logits = self.model.compute_logits(hidden[last_rows])  # [N, V] fp32
        return logits.argmax(dim=-1).tolist()


def check_draft_vocabulary(name: str, target_tokenizer, draft_tokenizer, target_vocab_size: int,
                           draft_vocab_size: int) -> None:
    """A draft's tokens are the target's only if both models and tokenizers agree on every
    id; a ValueError naming the draft otherwise."""
    where = f"--speculative-config: the draft model {name!r}"
    if draft_vocab_size != target_vocab_size:
        raise ValueError(f"{where} has a vocabulary of {draft_vocab_size} tokens, the target "
                         f"{target_vocab_size}: a draft needs the target's vocabulary")
    target, draft = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if target != draft:
        differ = sorted(set(target.items()) ^ set(draft.items()), key=lambda x: x[1])[:3]
        raise ValueError(f"{where} has another tokenizer than the target ({len(draft)} against "
                         f"{len(target)} entries; they differ at e.g. {differ}): a draft needs "
                         f"the target's vocabulary")
