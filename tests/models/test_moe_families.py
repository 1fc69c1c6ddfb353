"""The mixture-of-experts families (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, Granite MoE and its
shared variant, GLM-4.5 with DeepSeek's routing, ERNIE 4.5, Hunyuan, GPT-OSS) against transformers on the
same tiny checkpoints (``checkpoints.tiny_moe_dirs``): logits at every position of a 40-token
prompt and 40 greedy tokens after it, the greedy tokens themselves by vLLM's rule, the layers
that route, both layouts of the experts in a checkpoint, and the configs refused."""

from __future__ import annotations

import json

import pytest
import torch
from greedy import check_logprobs_close, hf_continuation
from paged_contexts import greedy_with_logits, random_prompt

from actorlm.kernels import select_backend
from actorlm.kernels.cpu import linear as cpu_linear
from actorlm.kernels.cpu.quant import QuantLinear
from actorlm.models.decoder import MLP
from actorlm.models.families import layer_specs
from actorlm.models.loader import load_hf_config, load_model
from actorlm.models.moe import SparseMoeBlock

FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "granitemoe", "granitemoeshared"]
# a router in fp32 and q/k norms after RoPE (Hunyuan's), attention sinks and experts with
# biases (GPT-OSS's), which the one-call step does not take
LAYER_BY_LAYER = ["hunyuan_moe", "gpt_oss"]
# routed by scores and a bias (DeepSeek's sigmoid routing, ERNIE's softmax), which the one-call
# decode step does not describe
SCORED = ["glm4_moe", "glm4_moe_unnormed", "ernie4_5_moe"]
PROMPT_LEN, NUM_DECODED = 40, 40
ATOL = {torch.float32: 2e-4, torch.bfloat16: None}  # bf16: judged by the greedy tokens only


@pytest.fixture(scope="module")
def hf_models(tiny_moe_dirs):
    """transformers' models in each dtype. bf16 is held to transformers in bf16, not fp32, as
    vLLM's tests hold it: a token whose router scores two experts a rounding apart goes to
    either, and the rest of the sequence follows, so only the same roundings of the router's
    input make the same choices (the dense families' bf16 tests can take fp32's)."""
    from transformers import AutoModelForCausalLM

    return {(name, dtype): AutoModelForCausalLM.from_pretrained(tiny_moe_dirs[name],
                                                                dtype=dtype).eval()
            for name in FAMILIES + SCORED + LAYER_BY_LAYER
            for dtype in (torch.float32, torch.bfloat16)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES + SCORED + LAYER_BY_LAYER)
def test_logits_at_every_position_match_transformers(family, dtype, tiny_moe_dirs, hf_models):
    theirs = hf_models[family, dtype]
    ours = load_model(tiny_moe_dirs[family], dtype, "cpu", select_backend("cpu"))
    prompt = random_prompt(ours.vocab_size, PROMPT_LEN)
    logits, tokens, tops = greedy_with_logits(ours, prompt, NUM_DECODED, block_size=4)
    try:
        check_logprobs_close([(tokens, tops)], [hf_continuation(theirs, prompt, NUM_DECODED)])
    except AssertionError:
        if dtype is not torch.bfloat16:
            raise
        # two bf16 runs may part at a near-tie, each within bf16's rounding of the fp32 run
        # (ERNIE's tiny model does, its logits' errors larger than a tie's margin): then both
        # must stay close to transformers in fp32
        exact = hf_continuation(hf_models[family, torch.float32], prompt, NUM_DECODED)
        check_logprobs_close([(tokens, tops)], [exact])
        check_logprobs_close([hf_continuation(theirs, prompt, NUM_DECODED)], [exact])
    if ATOL[dtype] is not None:
        with torch.inference_mode():  # one forward over the whole sequence: every position
            expected = theirs(torch.tensor([prompt + tokens[:-1]])).logits[0]
        torch.testing.assert_close(logits, expected, atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize("family", FAMILIES + SCORED + LAYER_BY_LAYER)
def test_the_layers_transformers_routes_route_here_and_take_the_one_call_where_described(
        family, tiny_moe_dirs, hf_models):
    ours = load_model(tiny_moe_dirs[family], torch.float32, "cpu", select_backend("cpu"))
    routed = [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.model.layers]
    # (a routed block has experts; Granite MoE's is its block_sparse_moe)
    assert routed == [hasattr(getattr(layer, "mlp", None) or layer.block_sparse_moe, "experts")
                      for layer in hf_models[family, torch.float32].model.layers]
    assert all(isinstance(layer.mlp, MLP) for layer, r in zip(ours.model.layers, routed) if not r)
    # the one-call decode step runs routed experts (where the panel GEMM is built), OLMoE's
    # q/k norms over whole projections included
    assert (ours.decode_step is not None) == \
        (cpu_linear._kernel(torch.float32) is not None and
         family not in SCORED + LAYER_BY_LAYER)
    assert any(routed) and (family not in ("qwen3_moe", "qwen2_moe", "glm4_moe",
                                           "ernie4_5_moe") or not all(routed))


@pytest.mark.parametrize("family", ["hunyuan_moe", "glm4_moe", "ernie4_5_moe"])
def test_routers_kept_in_fp32_score_in_fp32_in_a_bf16_model(tiny_moe_dirs, family):
    """Hunyuan's, GLM-4.5's and ERNIE's routers are fp32 in transformers whatever the model's
    dtype (``wg`` built fp32, ``_keep_in_fp32_modules_strict``): in a bf16 model their logits
    here are the fp32 product of the hidden state and the checkpoint's weights."""
    from safetensors.torch import load_file

    ours = load_model(tiny_moe_dirs[family], torch.bfloat16, "cpu", select_backend("cpu"))
    block = next(layer.mlp for layer in ours.model.layers if isinstance(layer.mlp, SparseMoeBlock))
    layer = next(i for i, l in enumerate(ours.model.layers) if l.mlp is block)
    [weights] = tiny_moe_dirs[family].glob("*.safetensors")
    router = next(t for name, t in load_file(weights).items()
                  if name.startswith(f"model.layers.{layer}.mlp.gate.") and name.endswith("weight"))
    x = torch.randn(3, router.shape[1], generator=torch.Generator().manual_seed(0))
    logits = block.gate(x.to(torch.bfloat16).float())
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, x.to(torch.bfloat16).float() @ router.float().T,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family, draft", [
    ("glm4_moe", lambda state: {name.replace("model.layers.2.", "model.layers.3."): t.clone()
                                for name, t in state.items()
                                if name.startswith("model.layers.2.")}),
    ("ernie4_5_moe", lambda state: {name.replace("model.layers.2.", "model.mtp_block.0."):
                                    t.clone() for name, t in state.items()
                                    if name.startswith("model.layers.2.")})])
def test_a_checkpoints_next_token_prediction_weights_are_left_out(tiny_moe_dirs, tmp_path,
                                                                  family, draft):
    """GLM-4.5's releases hold a multi-token-prediction layer past ``num_hidden_layers``,
    ERNIE 4.5's ``mtp`` tensors (a draft's), which the model does not run; loading leaves them
    out, as transformers does."""
    import shutil

    from safetensors.torch import load_file, save_file

    copy = shutil.copytree(tiny_moe_dirs[family], tmp_path / "with_mtp")
    [weights] = copy.glob("*.safetensors")
    state = load_file(weights)
    extra = {"model.mtp_linear_proj.0.weight" if family == "ernie4_5_moe" else
             "model.layers.3.eh_proj.weight": torch.zeros(64, 128)}
    save_file({**state, **draft(state), **extra}, weights, metadata={"format": "pt"})
    backend = select_backend("cpu")
    with_mtp = load_model(copy, torch.float32, "cpu", backend)
    plain = load_model(tiny_moe_dirs[family], torch.float32, "cpu", backend)
    assert len(with_mtp.model.layers) == 3
    prompt = random_prompt(plain.vocab_size, PROMPT_LEN)
    assert torch.equal(greedy_with_logits(with_mtp, prompt, 4, block_size=4)[0],
                       greedy_with_logits(plain, prompt, 4, block_size=4)[0])


@pytest.mark.parametrize("family", ["qwen3_moe", "granitemoe"])
def test_experts_saved_stacked_load_as_the_per_expert_tensors_do(tiny_moe_dirs, family):
    """The same weights, the experts written as the release does (Qwen3-MoE: one tensor per
    expert and projection; Granite MoE: stacked, under its own names), or as transformers
    holds them, stacked ([E, 2I, H] gate/up, [E, H, I] down): the same model, to the bit."""
    backend = select_backend("cpu")
    per_expert = load_model(tiny_moe_dirs[family], torch.float32, "cpu", backend)
    stacked = load_model(tiny_moe_dirs[f"{family}_stacked"], torch.float32, "cpu", backend)
    for a, b in zip(per_expert.model.layers, stacked.model.layers, strict=True):
        if isinstance(a.mlp, SparseMoeBlock):
            for x, y in zip(_expert_tensors(a.mlp.experts), _expert_tensors(b.mlp.experts)):
                assert torch.equal(x, y)
    prompt = random_prompt(per_expert.vocab_size, PROMPT_LEN)
    assert torch.equal(greedy_with_logits(per_expert, prompt, 4, block_size=4)[0],
                       greedy_with_logits(stacked, prompt, 4, block_size=4)[0])


def _expert_tensors(experts) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts' weights as the backend holds them: stacked, or packed for its kernel."""
    held = experts.stacked
    return (held.gate_up, held.down)


def _config(tiny_moe_dirs, tmp_path, family, **changes):
    config = json.loads((tiny_moe_dirs[family] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **changes}))
    return load_hf_config(tmp_path)


@pytest.mark.parametrize("family, changes, error", [
    ("qwen3_moe", {"routed_scaling_factor": 2.5}, "routed_scaling_factor=2.5"),
    ("qwen2_moe", {"n_group": 4, "topk_group": 2}, "n_group=4"),
    ("qwen3_moe", {"topk_method": "noaux_tc"}, "topk_method='noaux_tc'"),
    ("mixtral", {"scoring_func": "sigmoid"}, "scoring_func='sigmoid'"),
    ("olmoe", {"router_bias": True}, "router_bias=True"),
    ("mixtral", {"num_experts_per_tok": 9}, "num_experts_per_tok=9 must be between 1 and "
                                            "num_experts=8"),
    ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step=0"),
    ("olmoe", {"head_dim": 8}, "olmoe: head_dim=8 times 4 heads must be hidden_size=64"),
    ("olmoe", {"clip_qkv": 0.0}, "clip_qkv must be positive"),
    ("olmoe", {"sliding_window": 16}, "olmoe: sliding_window is not implemented"),
    ("granitemoeshared", {"shared_intermediate_size": -1},
     "granitemoeshared: shared_intermediate_size=-1 must be 0"),
    ("glm4_moe", {"n_group": 3}, "glm4_moe: n_group=3 and topk_group=1 do not choose 2 of 8"),
    ("glm4_moe", {"topk_group": 3}, "n_group=2 and topk_group=3"),
    ("ernie4_5_moe", {"use_bias": True}, "ernie4_5_moe: use_bias"),
    ("hunyuan_moe", {"moe_topk": [2, 1]}, r"moe_topk=\[2, 1\] \(a different count per layer"),
    ("gpt_oss", {"swiglu_limit": 5.0}, "gpt_oss: swiglu_limit=5.0 is not implemented"),
    ("gpt_oss", {"swiglu_alpha": 1.0}, "gpt_oss: swiglu_alpha=1.0 is not implemented"),
])
def test_configs_that_change_the_routing_unimplemented_are_refused_by_name(
        family, changes, error, tiny_moe_dirs, tmp_path):
    config = _config(tiny_moe_dirs, tmp_path, family, **changes)
    with pytest.raises(ValueError, match=error):
        layer_specs(config)


@pytest.mark.parametrize("family, changes", [
    ("mixtral", {"router_jitter_noise": 0.1}),  # noise on the router's input in training only
    ("qwen3_moe", {"router_aux_loss_coef": 0.5, "output_router_logits": True}),
    ("qwen3_moe", {"routed_scaling_factor": 1.0}),
])
def test_fields_that_matter_only_in_training_are_taken(family, changes, tiny_moe_dirs,
                                                       tmp_path):
    config = _config(tiny_moe_dirs, tmp_path, family, **changes)
    assert layer_specs(config) == layer_specs(load_hf_config(tiny_moe_dirs[family]))


def test_quantizing_puts_the_experts_in_blocks_too(tiny_moe_dirs):
    """``--quantization q8_0``: attention, dense MLPs, the shared expert and every routed
    expert in Q8_0 blocks (where their rows divide into blocks); the router and the shared
    expert's gate as they came (tests/models/test_moe_gguf.py holds the values)."""
    model = load_model(tiny_moe_dirs["qwen2_moe"], torch.float32, "cpu", select_backend("cpu"),
                       quantization="q8_0")
    dense, routed = model.model.layers[0], model.model.layers[1]
    assert isinstance(dense.mlp, MLP) and isinstance(routed.mlp, SparseMoeBlock)
    def in_blocks(linear):  # the layer the CPU wing prepared: one on the quantized kernels
        return isinstance(linear.prepared, QuantLinear) and \
            set(linear.prepared.type_names) == {"Q8_0"}

    for linear in (dense.self_attn.qkv_proj, dense.mlp.gate_up_proj, dense.mlp.down_proj,
                   routed.mlp.shared_expert.gate_up_proj):
        assert in_blocks(linear)
    # (the shared expert's down_proj has 48 input features, not whole blocks of 32: floats)
    assert not in_blocks(routed.mlp.shared_expert.down_proj)
    assert not in_blocks(routed.mlp.gate) and not in_blocks(routed.mlp.shared_expert_gate)
    experts = routed.mlp.experts.prepared  # each expert's layers on the quantized kernels
    assert experts.type_names == ["Q8_0"] and isinstance(experts.down[0], QuantLinear)
    prompt = random_prompt(model.vocab_size, PROMPT_LEN)
    logits = greedy_with_logits(model, prompt, 2, block_size=4)[0]
    assert logits.isfinite().all()
