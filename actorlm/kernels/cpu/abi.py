"""The C ABI of the C++ kernels, declared once: this table.

From it come both sides of the boundary: the header every ``csrc/*.cpp`` includes
(``actorlm_abi.h``, written by ``header()`` into the build, so the compiler checks each
definition against its declaration: a C function defined with other parameters than declared
does not compile) and the ctypes types (``function``'s argtypes, ``STRUCT_TYPES``). Print the
header with ``python -m actorlm.kernels.cpu.abi``.

``T`` is the element type: a function whose signature names it exists once per dtype, its name
suffixed ``_f32`` (``float``) or ``_bf16`` (``uint16_t``, bf16's bits). ``C`` is a KV cache's:
``T`` again, or an FP8 format's byte (``uint8_t``), the name then suffixed once more, ``_e4m3``
or ``_e5m2`` (``actorlm_decode_bf16_e4m3``); ``F`` is an FP8 cache's alone (no ``T`` variant).
"""

from __future__ import annotations

import ctypes
import functools

_DTYPES = {"f32": "float", "bf16": "uint16_t"}
_CACHE_TYPES = ("e4m3", "e5m2")  # a KV cache's FP8 formats, besides T

# Structs of the one-call decode step (``decode_step.py``): a layer's description and a step.
STRUCTS = {
    # weight null: the layer has no norm there; layer 1: a LayerNorm (the mean taken out; its
    # bias null or [dim]), 0: an RMS norm
    "actorlm_norm": [
        ("const void*", "weight"), ("float", "eps"), ("int32_t", "unit_offset"),
        ("const void*", "bias"), ("int32_t", "layer")],
    "actorlm_quant_part": [  # rows of a weight in one GGML block format (its ggml_type id);
        # layout 0: the file's, rows of blocks; 1: 16 rows interleaved (actorlm_quant_interleave)
        ("const void*", "blocks"), ("int32_t", "type"), ("int64_t", "rows"), ("int32_t", "layout")],
    # A linear layer: a PanelLinear (packed weight, fp32 bias padded to the panels or null) or
    # a QuantLinear (packed null; its parts stacked row-wise, fp32 bias of out_features or null);
    # fp8_inputs 1: its input rounded to FP8 first (kernels.ActivationQuant: fp8_scale, else 0
    # and a scale per fp8_group features, 0: per row)
    "actorlm_linear": [
        ("const void*", "packed"), ("const float*", "bias"), ("int64_t", "out_features"),
        ("int64_t", "in_features"), ("const actorlm_quant_part*", "parts"),
        ("int32_t", "num_parts"), ("int32_t", "fp8_inputs"), ("int32_t", "fp8_group"),
        ("float", "fp8_scale")],
    # A layer's routed experts, each projection's experts packed for the panel GEMM one after
    # another, `*_stride` values apart (``experts.PanelExperts``): the router's experts
    # first_expert .. first_expert + num_experts - 1 (all of them, or a rank's share)
    "actorlm_experts": [
        ("const void*", "gate_up"), ("const void*", "down"), ("int64_t", "gate_up_stride"),
        ("int64_t", "down_stride"), ("int64_t", "hidden"), ("int64_t", "intermediate"),
        ("int32_t", "num_experts"), ("int32_t", "activation"), ("int32_t", "first_expert")],
    # A mixture-of-experts MLP: router, routed experts, and a shared expert scaled by the
    # sigmoid of shared_gate (Qwen2-MoE; shared_gate.out_features 0: unscaled, Granite's;
    # shared_gate_up.out_features 0: none)
    "actorlm_moe": [
        ("actorlm_linear", "router"), ("actorlm_experts", "experts"), ("int32_t", "top_k"),
        ("int32_t", "renormalize"), ("actorlm_linear", "shared_gate_up"),
        ("actorlm_linear", "shared_down"), ("actorlm_linear", "shared_gate")],
    # A layer's LoRA slots (kernels.lora.LoRATable): a [slots, rank, in], b [slots, rank, out]
    # in the model's dtype; a merged layer's num_parts parts each own rank / num_parts columns
    # of the rank and the output rows up to part_ends[p] (num_parts ints); a null: no LoRA
    "actorlm_lora": [
        ("const void*", "a"), ("const void*", "b"), ("int32_t", "rank"),
        ("int32_t", "num_parts"), ("const int64_t*", "part_ends")],
    "actorlm_decoder_layer": [
        ("actorlm_norm", "attn_norm"), ("actorlm_norm", "attn_out_norm"),
        ("actorlm_norm", "mlp_norm"), ("actorlm_norm", "mlp_out_norm"),
        ("actorlm_norm", "q_norm"), ("actorlm_norm", "k_norm"),
        ("actorlm_linear", "qkv"), ("actorlm_linear", "o"), ("actorlm_linear", "gate_up"),
        ("actorlm_linear", "down"),
        ("void*", "k_cache"), ("void*", "v_cache"),  # [num_blocks, block_size, Hkv, D]
        ("int32_t", "num_heads"), ("int32_t", "num_kv_heads"), ("int32_t", "head_dim"),
        ("int32_t", "activation"),  # an index into ACTIVATIONS
        ("int32_t", "rope"), ("float", "scale"),
        ("int32_t", "window"), ("float", "softcap"),  # 0: none
        ("int32_t", "kv_group"),  # an index into the step's groups
        # 1: q_norm and k_norm span the whole projections, [Hq D] and [Hkv D] (OLMoE); 0: heads
        ("int32_t", "projection_norms"),
        ("float", "clip_qkv"),  # q, k and v clamped to +-clip_qkv after the norms; 0: none
        # attention's and MLP's outputs times this before they join the stream (Granite); 1:
        # none
        ("float", "residual_scale"),
        ("const actorlm_moe*", "moe"),  # null: the dense gate_up and down
        ("actorlm_lora", "qkv_lora"), ("actorlm_lora", "o_lora"),  # LoRA slots of each
        ("actorlm_lora", "gate_up_lora"), ("actorlm_lora", "down_lora"),
        # 1: the MLP reads attn_norm's output too, and its output is added to the attention's
        # (Phi-2, Cohere; no mlp_norm); 0: one after the other
        ("int32_t", "parallel"),
        ("int32_t", "gated"),  # 0: gate_up is one projection, act(up) alone (StarCoder2)
    ],
    # one KV-cache group's view of a step: its slot per row, its block table [rows, max_blocks]
    "actorlm_kv_group": [
        ("const int64_t*", "slots"), ("const int32_t*", "block_tables"),
        ("int32_t", "max_blocks")],
    # where a decode step's time went in its mixture-of-experts layers, summed over them: the
    # routers (linear and top-k) and the experts (routed and shared), in seconds
    "actorlm_moe_seconds": [("double", "router"), ("double", "experts")],
    "actorlm_decode_step": [  # one query token per request, request r on row r
        ("int64_t", "rows"), ("int32_t", "block_size"),
        ("const void* const*", "cos"), ("const void* const*", "sin_signed"),  # per RoPE table
        ("const actorlm_kv_group*", "groups"),  # per KV-cache group
        ("const int32_t*", "seq_lens"),
        ("actorlm_moe_seconds*", "moe_seconds"),  # added to by the step (null: not timed)
        ("const int32_t*", "lora_slots"),  # each row's LoRA slot, -1: none (null: no LoRA)
        ("int32_t", "kv_type")],  # what the caches hold: 0 T, 1 E4M3, 2 E5M2
}

# (return type, name, parameters)
FUNCTIONS = [
    # fused.cpp: a decoder layer's elementwise steps
    ("void", "actorlm_rms_norm", [
        ("const T*", "x"), ("int64_t", "x_stride"), ("T*", "out"), ("const T*", "weight"),
        ("int64_t", "rows"), ("int", "dim"), ("float", "eps"), ("int", "unit_offset")]),
    ("void", "actorlm_add_rms_norm", [
        ("T*", "x"), ("T*", "residual"), ("const T*", "weight"), ("int64_t", "rows"),
        ("int", "dim"), ("float", "eps"), ("int", "unit_offset")]),
    ("void", "actorlm_layer_norm", [  # bias may be null; out may be x
        ("const T*", "x"), ("int64_t", "x_stride"), ("T*", "out"), ("const T*", "weight"),
        ("const T*", "bias"), ("int64_t", "rows"), ("int", "dim"), ("float", "eps")]),
    ("void", "actorlm_act", [  # an ungated MLP's: out = act(x)
        ("const T*", "x"), ("T*", "out"), ("int64_t", "rows"), ("int", "dim"),
        ("int", "activation")]),
    ("void", "actorlm_head_rms_norm", [
        ("T*", "qkv"), ("int64_t", "row_stride"), ("int64_t", "rows"), ("int", "num_heads"),
        ("int", "num_kv_heads"), ("int", "head_dim"), ("const T*", "q_weight"),
        ("const T*", "k_weight"), ("float", "eps"), ("int", "unit_offset")]),
    ("void", "actorlm_round_to_fp8", [  # fp8.cpp: x's rows rounded to FP8 and back into out
        ("const T*", "x"), ("int64_t", "x_stride"), ("T*", "out"), ("int64_t", "rows"),
        ("int64_t", "k"), ("int32_t", "group"), ("float", "scale")]),
    ("void", "actorlm_act_and_mul", [
        ("const T*", "gate_up"), ("T*", "out"), ("int64_t", "rows"), ("int", "dim"),
        ("int", "activation")]),
    ("void", "actorlm_rope_write_kv", [
        ("T*", "qkv"), ("int64_t", "row_stride"), ("const T*", "cos"),
        ("const T*", "sin_signed"), ("C*", "k_cache"), ("C*", "v_cache"),
        ("const int64_t*", "slots"), ("int64_t", "rows"), ("int", "num_heads"),
        ("int", "num_kv_heads"), ("int", "head_dim")]),
    ("int", "actorlm_rope_max_head_dim", []),
    ("void", "actorlm_widen", [  # an FP8 cache's values widened: out = x
        ("const F*", "x"), ("T*", "out"), ("int64_t", "n")]),
    ("void", "actorlm_argmax_f32", [
        ("const float*", "x"), ("int64_t*", "out"), ("int64_t", "rows"), ("int64_t", "n")]),
    # decode_attention.cpp
    ("int", "actorlm_decode_limits", [
        ("int*", "max_group"), ("int*", "max_head_dim"), ("int*", "max_block_size")]),
    ("void", "actorlm_decode", [
        ("const T*", "query"), ("int64_t", "query_row_stride"), ("const int32_t*", "rows"),
        ("const C*", "k_cache"), ("const C*", "v_cache"), ("const int32_t*", "block_tables"),
        ("int", "max_blocks"), ("const int32_t*", "seq_lens"), ("T*", "out"),
        ("int", "num_requests"), ("int", "num_heads"), ("int", "num_kv_heads"),
        ("int", "head_dim"), ("int", "block_size"), ("float", "scale"),
        ("int", "window"), ("float", "softcap")]),  # 0: none (a sliding window, a score cap)
    # linear.cpp
    ("int", "actorlm_linear_panel_f32", []),
    ("int", "actorlm_linear_panel_bf16", []),
    ("int", "actorlm_linear_amx", [("int", "on")]),  # bf16 on AMX tiles: 1/0 set, else ask
    ("void", "actorlm_linear_pack", [
        ("const T*", "weight"), ("T*", "packed"), ("int64_t", "n"), ("int64_t", "k")]),
    ("void", "actorlm_linear_unpack", [  # actorlm_linear_pack undone
        ("const T*", "packed"), ("T*", "weight"), ("int64_t", "n"), ("int64_t", "k")]),
    ("void", "actorlm_linear", [
        ("const T*", "x"), ("int64_t", "x_stride"), ("const T*", "packed"),
        ("const float*", "bias"), ("T*", "y"), ("int64_t", "m"), ("int64_t", "n"),
        ("int64_t", "k")]),
    ("void", "actorlm_linear_rowwise", [  # each row the same whatever the rows: the experts'
        ("const T*", "x"), ("int64_t", "x_stride"), ("const T*", "packed"),
        ("const float*", "bias"), ("T*", "y"), ("int64_t", "m"), ("int64_t", "n"),
        ("int64_t", "k")]),
    # moe.cpp: routed experts (ids [rows, top_k] int64, weights [rows, top_k] fp32)
    ("void", "actorlm_moe_route", [
        ("const T*", "logits"), ("int64_t", "rows"), ("int", "num_experts"), ("int", "top_k"),
        ("int", "renormalize"), ("int64_t*", "ids"), ("float*", "weights")]),
    ("void", "actorlm_moe_experts", [
        ("const actorlm_experts*", "experts"), ("const T*", "x"), ("const int64_t*", "ids"),
        ("const float*", "weights"), ("T*", "out"), ("int64_t", "rows"), ("int", "top_k")]),
    # lora.cpp: rows of y [rows, out] += their slot's x @ A.T @ B (slots [rows], -1: none)
    ("void", "actorlm_lora_add", [
        ("const actorlm_lora*", "lora"), ("const T*", "x"), ("int64_t", "x_stride"),
        ("T*", "y"), ("int64_t", "y_stride"), ("int64_t", "rows"), ("int64_t", "in_features"),
        ("int64_t", "out_features"), ("const int32_t*", "slots")]),
    ("int", "actorlm_lora_isa", []),  # 0 portable, 1 avx512
    ("int", "actorlm_lora_set_isa", [("int", "isa")]),  # -1 where this CPU or build lacks it
    # decode_step.cpp
    ("void", "actorlm_decode_layers", [
        ("const actorlm_decoder_layer*", "layers"), ("int", "num_layers"),
        ("const actorlm_decode_step*", "step"), ("T*", "x"), ("T*", "residual")]),
    # quant.cpp: linear layers over GGML blocks (isa: 0 scalar, 1 avx2, 2 avx512_vnni)
    ("int", "actorlm_quant_isa", []),
    ("int", "actorlm_quant_set_isa", [("int", "isa")]),  # -1 where this CPU or build lacks it
    ("int", "actorlm_quant_kept", [("int32_t", "type")]),  # a ggml_type id
    ("int", "actorlm_quant_interleave", [
        ("int32_t", "type"), ("const uint8_t*", "src"), ("int64_t", "rows"),
        ("int64_t", "in_features"), ("uint8_t*", "dst")]),
    # x rows from which a layer runs the dequantized-panel path (0: never); the setter's rows
    # for every layer (< 1: the measured defaults)
    ("int", "actorlm_quant_panel_from_rows", [
        ("const actorlm_linear*", "linear"), ("int", "bf16")]),
    ("void", "actorlm_quant_set_panel_from_rows", [("int", "rows")]),
    ("void", "actorlm_quant_linear", [  # y [m, out_features] contiguous, not overlapping x
        ("const actorlm_linear*", "linear"), ("const T*", "x"), ("int64_t", "x_stride"),
        ("T*", "y"), ("int64_t", "m")]),
    ("void", "actorlm_quant_dequantize_rows", [
        ("const actorlm_quant_part*", "part"), ("int64_t", "in_features"),
        ("const int64_t*", "rows"), ("int64_t", "num_rows"), ("T*", "out")]),
]


def _concrete() -> dict[str, tuple[str, list[tuple[str, str]]]]:
    """Every exported function's name -> (return type, parameters), T spelled out."""
    out = {}
    for restype, name, params in FUNCTIONS:
        if not any("T*" in ctype for ctype, _ in params):
            out[name] = (restype, params)
            continue
        caches = ("",)  # (none: T's alone)
        if any("C*" in ctype for ctype, _ in params):
            caches = ("", *_CACHE_TYPES)
        elif any("F*" in ctype for ctype, _ in params):
            caches = _CACHE_TYPES
        for suffix, element in _DTYPES.items():
            for cache in caches:
                stored = "uint8_t" if cache else element
                out[f"{name}_{suffix}" + (f"_{cache}" if cache else "")] = (restype, [
                    (ctype.replace("T*", f"{element}*").replace("C*", f"{stored}*")
                     .replace("F*", f"{stored}*"), p) for ctype, p in params])
    return out


def header() -> str:
    """The text of ``actorlm_abi.h``."""
    lines = ["// Generated from actorlm/kernels/cpu/abi.py: the C ABI of the CPU kernels.",
             "#pragma once", "#include <cstdint>", "", 'extern "C" {', ""]
    for name, fields in STRUCTS.items():
        body = " ".join(f"{ctype} {field};" for ctype, field in fields)
        lines.append(f"typedef struct {name} {{ {body} }} {name};")
    lines.append("")
    for name, (restype, params) in _concrete().items():
        args = ", ".join(f"{ctype} {p}" for ctype, p in params) or "void"
        lines.append(f"{restype} {name}({args});")
    lines += ["", '}  // extern "C"', ""]
    return "\n".join(lines)


_SCALARS = {"void": None, "float": ctypes.c_float, "double": ctypes.c_double,
            "int": ctypes.c_int, "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64}


def _ctype(ctype: str, structs: dict[str, type]):
    """The ctypes type of a C type of the table: a struct, a pointer to one, any other pointer
    (c_void_p: tensors pass their data_ptr()), or a scalar."""
    words = ctype.replace("const", "").split()
    base = words[0].rstrip("*")
    if base in STRUCTS:
        struct = structs[base]
        return ctypes.POINTER(struct) if "*" in ctype else struct
    return ctypes.c_void_p if "*" in ctype else _SCALARS[base]


def _struct_types() -> dict[str, type]:
    types: dict[str, type] = {}
    for name, fields in STRUCTS.items():  # in order: a struct names only those before it
        types[name] = type(name, (ctypes.Structure,), {"_fields_": [
            (field, _ctype(ctype, types)) for ctype, field in fields]})
    return types


STRUCT_TYPES = _struct_types()


@functools.cache
def signature(name: str) -> tuple:
    """(restype, argtypes) of the exported function ``name`` (with its dtype suffix)."""
    restype, params = _concrete()[name]
    return _SCALARS[restype], [_ctype(ctype, STRUCT_TYPES) for ctype, _ in params]


if __name__ == "__main__":
    print(header(), end="")
