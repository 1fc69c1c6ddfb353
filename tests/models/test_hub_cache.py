"""A Hub repository id as the model (``vllm serve Qwen/Qwen2.5-0.5B-Instruct``): read from the
snapshot already in the local Hugging Face cache, at ``--revision``, from ``--download-dir``;
never downloaded, and a repository that is not there is refused saying so."""

from __future__ import annotations

import shutil
import types

import pytest

from actorlm import LLM, SamplingParams
from actorlm.api.server_state import default_model_name
from actorlm.models.loader import resolve_model

MAIN, TAGGED = "a" * 40, "b" * 40  # the commits the cache holds


@pytest.fixture(scope="module")
def hub_cache(tiny_llama_dir, tiny_qwen2_dir, tmp_path_factory):
    """A Hugging Face cache holding acme/tiny at main (the tiny Llama) and at tag v1 (the tiny
    Qwen2), and acme/tiny-gguf, a repository of GGUF files only, as huggingface-cli leaves
    them."""
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / "models--acme--tiny"
    for commit, source, ref in ((MAIN, tiny_llama_dir, "main"), (TAGGED, tiny_qwen2_dir, "v1")):
        shutil.copytree(source, repo / "snapshots" / commit)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    ggufs = cache / "models--acme--tiny-gguf"
    (ggufs / "snapshots" / MAIN).mkdir(parents=True)
    (ggufs / "refs").mkdir()
    (ggufs / "refs" / "main").write_text(MAIN)
    for name in ("tiny-Q4_0.gguf", "tiny-Q8_0.gguf"):
        (ggufs / "snapshots" / MAIN / name).write_bytes(b"GGUF")
    return cache


def test_a_repository_id_resolves_to_its_cached_snapshot(hub_cache):
    snapshots = hub_cache / "models--acme--tiny" / "snapshots"
    assert resolve_model("acme/tiny", download_dir=str(hub_cache)) == snapshots / MAIN
    assert resolve_model("acme/tiny", "v1", str(hub_cache)) == snapshots / TAGGED
    assert resolve_model("acme/tiny", TAGGED, str(hub_cache)) == snapshots / TAGGED


def test_what_the_cache_does_not_hold_is_refused_without_a_download(hub_cache, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # (even where the Hub is reachable)
    with pytest.raises(ValueError, match=r"acme/elsewhere.*never downloaded.*"
                                         r"huggingface-cli download acme/elsewhere"):
        resolve_model("acme/elsewhere", download_dir=str(hub_cache))
    with pytest.raises(ValueError, match=f"{hub_cache} at v9"):
        resolve_model("acme/tiny", "v9", str(hub_cache))
    with pytest.raises(ValueError, match="give one of them.*tiny-Q4_0.gguf, tiny-Q8_0.gguf"):
        resolve_model("acme/tiny-gguf", download_dir=str(hub_cache))


def test_the_engine_runs_it_and_the_server_names_it_by_its_id(hub_cache, tiny_llama_dir):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with LLM("acme/tiny", download_dir=str(hub_cache), dtype="float32") as llm:
        by_id = llm.generate(["Hello there"], params, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(str(tiny_llama_dir), dtype="float32") as llm:
        by_dir = llm.generate(["Hello there"], params, use_tqdm=False)[0].outputs[0].token_ids
    assert by_id == by_dir
    engine = types.SimpleNamespace(config=types.SimpleNamespace(model="acme/tiny"))
    assert default_model_name(engine) == "acme/tiny"
