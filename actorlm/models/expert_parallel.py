"""Expert parallelism (``--enable-expert-parallel``): a mixture of experts' routed experts
placed whole on the tensor-parallel ranks, in place of every expert split across them.

Rank r of N holds experts [r E/N, (r+1) E/N), each with all of its intermediate features
(``TensorParallel.local_experts``); the router stays on every rank, and attention, the dense
MLPs and a shared expert keep their tensor-parallel split. The activations are the same on
every rank already, so every rank routes every token and runs only its own experts (a token's
slots on other ranks' experts add nothing there): the MoE block's output is a partial sum on
each rank, and the ``all_reduce`` that joins a split expert's partial sums joins these too.
This is vLLM's expert parallelism over the TP ranks in its naive form, without the all-gather
(the tokens are on every rank) or an all-to-all. Each expert's matmuls then run whole on one
rank rather than as N thin slices, and a decode step reads an expert's weights on one rank
only. On one rank the flag changes nothing: that rank holds every expert.

vLLM gives the remainder of an uneven split to the first ranks and ignores the flag on a dense
model; here both are refused before anything loads, naming the flags (an uneven split would
leave one rank the slowest at every MoE layer, and a flag with no effect is a mistake worth
hearing about).
"""

from __future__ import annotations

from actorlm.models.moe_families import EXPERTS_SIZE, intermediate_sizes, moe_specs


def check_expert_parallel(name: str, config, size: int, enabled: bool) -> None:
    """Raise ValueError, naming the flags, if ``--enable-expert-parallel`` cannot place the
    model ``name``'s experts on ``size`` ranks: a model without routed experts, or a number
    of experts that ``size`` does not divide."""
    if not enabled:
        return
    routed = next((spec for spec in moe_specs(config) if spec is not None), None)
    if routed is None:
        raise ValueError(f"--enable-expert-parallel applies only to mixtures of experts; "
                         f"{name} ({config.model_type}) has no routed experts: drop the flag")
    if routed.num_experts % size:
        raise ValueError(f"--tensor-parallel-size {size} does not divide {name}'s "
                         f"{routed.num_experts} experts under --enable-expert-parallel; use a "
                         f"divisor of {routed.num_experts}, or drop --enable-expert-parallel "
                         f"to split every expert instead")


def split_intermediate_sizes(config, expert_parallel: bool) -> dict[str, int]:
    """``moe_families.intermediate_sizes`` that tensor parallelism splits: under expert
    parallelism, not the routed experts' (each is held whole)."""
    sizes = intermediate_sizes(config)
    if expert_parallel:
        sizes.pop(EXPERTS_SIZE, None)
    return sizes
