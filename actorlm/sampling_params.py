"""SamplingParams: vLLM's field names, defaults and validation ranges."""

from __future__ import annotations

import msgspec

_GREEDY_EPS = 1e-5  # vLLM treats temperatures below this as greedy


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to sample one request. Validated on construction; every error names the field."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        _check(self.n == 1, "n", f"n must be 1 (got {self.n}); n > 1 is not supported yet")
        _check(0.0 <= self.temperature <= 2.0, "temperature",
               f"temperature must be in [0, 2], got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= -1, "top_k",
               f"top_k must be 0 or -1 (disabled) or at least 1, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
               f"max_tokens must be at least 1, got {self.max_tokens}")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               f"stop_token_ids must be non-negative token ids, got {self.stop_token_ids}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field}: {message}" if not message.startswith(field) else message)
