"""rejection_sample (Triton, interpreted on the CPU) against the torch verifier
(``kernels/rejection.py``), token for token.

The two share their target distributions and their noise (the kernel is handed what torch
computes), so they must agree exactly: on greedy rows (the argmax, lowest index on ties), on
the acceptance of each sampled draft (u < p(d)) and on the token recovered after a rejection or
drawn at the bonus row (the race over p, the rejected draft removed). The torch verifier is
itself held to the target distribution by ``test_rejection_sampler``. Batches mix greedy and
sampled requests with 0 to 4 drafts and top-k / top-p / min-p, over enough trials that every
outcome of the walk occurs (checked), so a kernel that accepted one draft too many or too few,
or drew from the wrong row, would differ somewhere.
"""

from __future__ import annotations

import pytest
import torch

from actorlm.kernels import rejection as torch_rejection
from actorlm.kernels.triton import rejection as triton_rejection
from actorlm.kernels.triton.backend import TritonBackend

VOCAB_SIZE = 50  # not a power of two: the last chunk is masked
NUM_TRIALS = 12

# one request per entry: (temperature, top_k, top_p, min_p, num_drafts); temperature 0: greedy
REQUESTS = [
    (0.0, 0, 1.0, 0.0, 3),
    (1.0, 0, 1.0, 0.0, 0),  # sampled, no drafts: the bonus row alone
    (0.8, 8, 1.0, 0.0, 4),  # top-k
    (0.0, 0, 1.0, 0.0, 0),  # greedy, no drafts
    (1.2, 0, 0.9, 0.0, 2),  # top-p
    (1.0, 20, 0.8, 0.05, 4),  # all three
]
MIN_P_REQUEST = (1.0, 0, 1.0, 0.2, 1)


def request_params(requests, gen):
    """The per-request tensors: the settings of ``requests``, random seeds and positions."""
    columns = list(zip(*requests))
    num_requests = len(requests)
    return dict(
        temperature=torch.tensor(columns[0], dtype=torch.float32),
        top_k=torch.tensor(columns[1], dtype=torch.int32),
        top_p=torch.tensor(columns[2], dtype=torch.float32),
        min_p=torch.tensor(columns[3], dtype=torch.float32),
        seeds=torch.randint(0, 2**40, (num_requests,), generator=gen),
        positions=torch.randint(0, 1000, (num_requests,), generator=gen),
    ), list(columns[4])


def plausible_drafts(logits, num_drafts, gen, right=0.7):
    """[R - B] drafts: each row's argmax with probability ``right`` (so greedy drafts are often
    accepted and sampled ones often likely), else a random token."""
    drafts, row = [], 0
    for k in num_drafts:
        for j in range(k):
            best = int(logits[row + j].argmax())
            guess = int(torch.randint(0, logits.shape[1], (1,), generator=gen))
            drafts.append(best if torch.rand(1, generator=gen).item() < right else guess)
        row += k + 1
    return torch.tensor(drafts, dtype=torch.int64)


def random_batch(requests, gen, scale=3.0):
    params, num_drafts = request_params(requests, gen)
    logits = torch.randn(sum(num_drafts) + len(num_drafts), VOCAB_SIZE, generator=gen) * scale
    return logits, num_drafts, plausible_drafts(logits, num_drafts, gen), params


def verify(fn, logits, num_drafts, drafts, params):
    p = params
    return fn(logits, num_drafts, drafts, p["temperature"], p["top_k"], p["top_p"], p["min_p"],
              p["seeds"], p["positions"])


def assert_same_tokens(logits, num_drafts, drafts, params):
    """The Triton result equals the torch one; returns it."""
    expected = verify(torch_rejection.rejection_sample, logits, num_drafts, drafts, params)
    got = verify(triton_rejection.rejection_sample, logits, num_drafts, drafts, params)
    assert got.dtype == torch.int64 and got.shape == expected.shape
    assert torch.equal(got, expected), f"triton\n{got}\ntorch\n{expected}\ndrafts {drafts}"
    return got


def outcome(num_accepted, k):
    return "none" if num_accepted == 0 else "all" if num_accepted == k else "some"


def test_mixed_batches_match_the_torch_verifier_and_reach_every_outcome():
    gen = torch.Generator().manual_seed(0)
    seen = {"greedy": set(), "sampled": set()}
    for _ in range(NUM_TRIALS):
        logits, num_drafts, drafts, params = random_batch(REQUESTS, gen)
        out = assert_same_tokens(logits, num_drafts, drafts, params)
        for b, k in enumerate(num_drafts):
            if k:
                kind = "greedy" if params["temperature"][b] == 0 else "sampled"
                seen[kind].add(outcome(int((out[b] >= 0).sum()) - 1, k))
    # the walk stopped at the first draft, in the middle and at the bonus row, on both paths
    assert seen == {"greedy": {"none", "some", "all"}, "sampled": {"none", "some", "all"}}


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_batches_of_one_kind_match(kind):
    """No sampled row (the kernel gets no distributions), or no greedy one."""
    gen = torch.Generator().manual_seed(1)
    settings = (0.0, 0, 1.0, 0.0) if kind == "greedy" else (0.9, 0, 0.95, 0.0)
    requests = [settings + (k,) for k in (4, 1, 0, 2)]
    for _ in range(3):
        assert_same_tokens(*random_batch(requests, gen))


def test_min_p_and_a_draft_outside_the_support_match():
    """A draft the truncation removed has p(d) = 0: always rejected, and p without it is p."""
    gen = torch.Generator().manual_seed(2)
    logits, num_drafts, _, params = random_batch([MIN_P_REQUEST] * 4, gen)
    drafts = logits[0::2].argmin(-1)  # each request's one draft: its least likely token
    out = assert_same_tokens(logits, num_drafts, drafts, params)
    assert (out[:, 0] != drafts).all() and (out[:, 1] == -1).all()


def test_greedy_ties_take_the_lowest_index_across_chunks(monkeypatch):
    """Rows with equal maxima at two places, the vocabulary streamed in chunks of 16: the
    argmax (as a draft's check and as the token) is the first, as torch's is."""
    monkeypatch.setattr(triton_rejection, "_MAX_BLOCK_V", 16)
    gen = torch.Generator().manual_seed(3)
    logits, num_drafts, _, params = random_batch([(0.0, 0, 1.0, 0.0, 2)] * 2, gen)
    logits[:, [5, 37]] = 30.0  # ties in chunks 0 and 2
    drafts = torch.tensor([5, 5, 5, 37])  # request 0: all accepted; request 1: rejected at 1
    out = assert_same_tokens(logits, num_drafts, drafts, params)
    assert out.tolist() == [[5, 5, 5], [5, 5, -1]]


def test_chunked_vocabulary_matches(monkeypatch):
    monkeypatch.setattr(triton_rejection, "_MAX_BLOCK_V", 16)
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        assert_same_tokens(*random_batch(REQUESTS, gen))


def test_the_triton_backend_verifies_with_the_kernel(monkeypatch):
    calls = []
    kernel_path = triton_rejection.rejection_sample

    def spy(*args):
        calls.append(len(args[1]))
        return kernel_path(*args)

    monkeypatch.setattr(triton_rejection, "rejection_sample", spy)
    logits, num_drafts, drafts, params = random_batch(REQUESTS, torch.Generator().manual_seed(5))
    got = verify(TritonBackend(logits.device).rejection_sample, logits, num_drafts, drafts,
                 params)
    assert calls == [len(REQUESTS)]
    assert torch.equal(got, verify(torch_rejection.rejection_sample, logits, num_drafts, drafts,
                                   params))
