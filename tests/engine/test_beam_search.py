"""Beam search (``LLM.beam_search``, ``actorlm.beam_search``) against transformers.

Without end tokens it is transformers' own ``generate(num_beams=...)``: the same beams, best
first, with the same cumulative logprobs. With an end token among the candidates (a copy of
the tiny Llama whose generation config names a token it often ranks high), the beams that end
are judged against a reference search written here over transformers' logits: every live
beam's 2 x width best next tokens, an end token finishing its beam, the best width of the
rest living on, finished and live ranked by cumulative logprob / generated length ** the
length penalty.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from actorlm import BeamSearchParams

PROMPTS = [[5, 17, 33, 9, 41, 12], [101, 7, 250, 3, 88, 64, 19, 2, 140]]
WIDTH, STEPS = 3, 8


@pytest.fixture(scope="module")
def theirs(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def test_without_end_tokens_the_beams_are_transformers(make_llm, tiny_llama_dir, theirs):
    llm = make_llm(str(tiny_llama_dir), block_size=4)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS],
                           BeamSearchParams(beam_width=WIDTH, max_tokens=STEPS, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        with torch.inference_mode():
            hf = theirs.generate(torch.tensor([prompt]), num_beams=WIDTH,
                                 num_return_sequences=WIDTH, max_new_tokens=STEPS,
                                 do_sample=False, eos_token_id=None, pad_token_id=0,
                                 output_scores=True, return_dict_in_generate=True)
        assert [s.tokens for s in out.sequences] == hf.sequences.tolist()
        # transformers' score: the cumulative logprob over the generated length
        assert [s.cum_logprob for s in out.sequences] == pytest.approx(
            (hf.sequences_scores * STEPS).tolist(), abs=1e-4)
        assert all(s.finish_reason == "length" for s in out.sequences)
        assert out.sequences[0].text == llm.tokenizer.decode(out.sequences[0].tokens,
                                                             skip_special_tokens=True)


def _reference(model, prompt: list[int], ends: frozenset[int], width: int, steps: int,
               length_penalty: float) -> list[tuple[list[int], float, str]]:
    """The documented search, over transformers' logprobs: (tokens, cumulative logprob,
    finish reason) of the best ``width``."""
    def score(tokens, cum, reason):
        length = len(tokens) - len(prompt) - (reason == "stop")
        return cum / max(length, 1) ** length_penalty

    live, done = [(prompt, 0.0)], []
    for _ in range(steps):
        grown = []
        for tokens, cum in live:
            with torch.inference_mode():
                logprobs = torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1], -1)
            top = logprobs.topk(2 * width)
            for value, token in zip(top.values.tolist(), top.indices.tolist()):
                beam = (tokens + [token], cum + value)
                (done if token in ends else grown).append(beam)
        live = sorted(grown, key=lambda b: score(*b, "length"), reverse=True)[:width]
    ranked = sorted([(*b, "stop") for b in done] + [(*b, "length") for b in live],
                    key=lambda b: score(*b), reverse=True)
    return ranked[:width]


def test_beams_that_end_are_ranked_by_their_length(make_llm, tiny_llama_dir, theirs, tmp_path):
    end = 284  # (a token the tiny Llama ranks high after these prompts)
    model_dir = tmp_path / "ends-at-284"
    shutil.copytree(tiny_llama_dir, model_dir)
    generation = json.loads((model_dir / "generation_config.json").read_text())
    (model_dir / "generation_config.json").write_text(json.dumps({**generation,
                                                                  "eos_token_id": end}))
    llm = make_llm(str(model_dir), block_size=4)
    ends = llm.engine.eos_token_ids  # (the tokenizer's <|im_end|> ends beams too)
    assert end in ends
    found = {}
    for length_penalty in (1.0, 0.0, 2.0):
        params = BeamSearchParams(beam_width=WIDTH, max_tokens=STEPS,
                                  length_penalty=length_penalty)
        outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
        for prompt, out in zip(PROMPTS, outs):
            expected = _reference(theirs, prompt, ends, WIDTH, STEPS, length_penalty)
            assert [(s.tokens, s.finish_reason) for s in out.sequences] == \
                [(tokens, reason) for tokens, _, reason in expected]
            assert [s.cum_logprob for s in out.sequences] == \
                pytest.approx([cum for _, cum, _ in expected], abs=1e-4)
            assert all(s.tokens[-1] in ends for s in out.sequences
                       if s.finish_reason == "stop")
        found[length_penalty] = [[s.tokens for s in out.sequences] for out in outs]
    # beams ended early, and the penalty changed the ranking (else this tests neither)
    assert any(len(tokens) < len(prompt) + STEPS
               for prompt, beams in zip(PROMPTS, found[0.0]) for tokens in beams)
    assert found[0.0] != found[2.0]


def test_the_search_stops_at_the_context_and_refuses_what_it_cannot_run(make_llm,
                                                                         tiny_llama_dir):
    llm = make_llm(str(tiny_llama_dir), block_size=4, max_model_len=12)
    out = llm.beam_search([PROMPTS[1]], BeamSearchParams(beam_width=2, max_tokens=50,
                                                         ignore_eos=True))[0]
    assert [len(s.tokens) for s in out.sequences] == [12, 12]  # the context's end
    with pytest.raises(ValueError, match="beam_width 11: .* at most 20 .--max-logprobs"):
        llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=11, max_tokens=4))
    for bad in (dict(beam_width=0, max_tokens=4), dict(beam_width=2, max_tokens=0),
                dict(beam_width=2, max_tokens=4, length_penalty=math.nan),
                dict(beam_width=2, max_tokens=4, temperature=-1.0)):
        with pytest.raises(ValueError):
            BeamSearchParams(**bad)
    for extreme in (1e308, -1e308):  # (a length to that power under- or overflows)
        out = llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=2, max_tokens=3,
                                                             length_penalty=extreme))[0]
        assert len(out.sequences) == 2
    with pytest.raises(ValueError, match="vocabulary"):
        llm.beam_search([[10**6]], BeamSearchParams(beam_width=2, max_tokens=4))
    assert llm.generate([PROMPTS[0]], use_tqdm=False)[0].outputs[0].token_ids  # still serving


def test_the_core_in_its_own_process_searches_alike(make_llm, tiny_llama_dir, tmp_path):
    """(its frontend knows the end tokens the core stops at: a generation config's as well)"""
    model_dir = tmp_path / "ends-at-284"
    shutil.copytree(tiny_llama_dir, model_dir)
    generation = json.loads((model_dir / "generation_config.json").read_text())
    (model_dir / "generation_config.json").write_text(json.dumps({**generation,
                                                                  "eos_token_id": 284}))
    params = BeamSearchParams(beam_width=WIDTH, max_tokens=STEPS, length_penalty=0.0)
    results = []
    for engine_core_process in (False, True):
        llm = make_llm(str(model_dir), block_size=4, engine_core_process=engine_core_process)
        assert 284 in llm.engine.eos_token_ids
        out = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
        results.append([[(s.tokens, s.finish_reason) for s in o.sequences] for o in out])
    assert results[0] == results[1]
    assert any(reason == "stop" for beams in results[0] for _, reason in beams)
