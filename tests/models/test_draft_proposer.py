"""The draft model's proposer against transformers: after any sequence of verifications
(drafts accepted in part, a bonus or a correction appended, requests preempted and new ones
joining), its drafts are the draft model's greedy continuation of each request's tokens,
although it computes only the positions its paged KV cache does not hold yet."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from actorlm.kernels import select_backend
from actorlm.models.draft_proposer import DraftModelProposer, check_draft_vocabulary
from actorlm.models.loader import load_model

K = 3


def _proposer(path, num_blocks=64, block_size=4, k=K):
    backend = select_backend(torch.device("cpu"))
    model = load_model(path, torch.float32, torch.device("cpu"), backend)
    proposer = DraftModelProposer(model, backend, k, block_size, torch.float32,
                                  torch.device("cpu"))
    proposer.allocate_kv_cache(num_blocks)
    return proposer


def _greedy(hf, tokens, k=K):
    """transformers' greedy continuation of ``tokens``, recomputed from scratch."""
    ids = list(tokens)
    with torch.no_grad():
        for _ in range(k):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(tokens):]


def _verify(rng, tokens, drafts):
    """What a verification might leave: a prefix of the drafts, then a token of the target's
    (after a rejection: one that is not the rejected draft)."""
    accepted = rng.randrange(len(drafts) + 1)
    tokens += drafts[:accepted]
    bonus = rng.randrange(3, 300)
    if accepted < len(drafts) and bonus == drafts[accepted]:
        bonus += 1
    tokens.append(bonus)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_drafts_are_the_draft_models_greedy_continuation(tiny_llama_dir, tiny_qwen2_dir,
                                                         family):
    path = {"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir}[family]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    proposer = _proposer(path)
    rng = random.Random(1)
    requests = {f"r{i}": [rng.randrange(3, 300) for _ in range(n)] for i, n in
                enumerate((5, 13, 1))}
    for round_ in range(8):
        if round_ == 3:  # one is preempted: it starts again, from its tokens so far
            proposer.forget("r1")
        if round_ == 4:
            requests["r3"] = [rng.randrange(3, 300) for _ in range(9)]
        ids = list(requests)
        if round_ == 5:  # one is not asked this time: its tokens move on without drafts
            ids.remove("r0")
            requests["r0"] += [rng.randrange(3, 300) for _ in range(2)]
        drafts = proposer.propose_all(ids, [requests[r] for r in ids])
        assert drafts == [_greedy(hf, requests[r]) for r in ids]
        for request_id, proposed in zip(ids, drafts):
            _verify(rng, requests[request_id], proposed)
    held = [b for s in proposer.states.values() for b in s.block_ids]
    assert len(held) == len(set(held))  # no block in two tables
    for request_id in list(requests):
        proposer.forget(request_id)
    assert sorted(proposer.free_block_ids) == list(range(64))  # every block back


def test_a_request_that_does_not_fit_gets_no_drafts_until_blocks_free(tiny_llama_dir):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    proposer = _proposer(tiny_llama_dir, num_blocks=6, block_size=4)
    first, second = list(range(10, 25)), list(range(30, 40))  # 5 and 4 blocks with the drafts
    assert proposer.propose_all(["a", "b"], [first, second]) == [_greedy(hf, first), []]
    proposer.forget("a")
    assert proposer.propose_all(["b"], [second]) == [_greedy(hf, second)]
    # past the draft's context (max_position_embeddings 512): no drafts, no error
    assert proposer.propose_all(["c"], [[5] * 511]) == [[]]


def test_another_vocabulary_is_refused_by_name():
    vocab = {"a": 0, "b": 1, "c": 2}

    class Tokenizer:
        def __init__(self, entries):
            self.entries = entries

        def get_vocab(self):
            return dict(self.entries)

    with pytest.raises(ValueError, match="'draft'.*vocabulary of 4 tokens, the target 3"):
        check_draft_vocabulary("draft", Tokenizer(vocab), Tokenizer(vocab), 3, 4)
    swapped = {"a": 1, "b": 0, "c": 2}
    with pytest.raises(ValueError, match="'draft' has another tokenizer"):
        check_draft_vocabulary("draft", Tokenizer(vocab), Tokenizer(swapped), 3, 3)
    check_draft_vocabulary("draft", Tokenizer(vocab), Tokenizer(dict(vocab)), 3, 3)
