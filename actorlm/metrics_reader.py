"""A registry's metrics as records (vLLM's ``vllm.v1.metrics.reader``, which
``LLM.get_metrics()`` returns): a ``Counter``, ``Gauge`` or ``Histogram`` per labelled sample,
and the counters labelled by ``position`` as one ``Vector`` (vLLM's
``vllm:spec_decode_num_accepted_tokens_per_pos``). Only the engine's own metrics (``vllm:``,
``actorlm:``) are read."""

from __future__ import annotations

from dataclasses import dataclass

PREFIXES = ("vllm:", "actorlm:")


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Vector(Metric):
    values: list[int]  # by position


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict[str, int]  # upper bound ("le") -> observations at or below it


def snapshot(registry) -> list[Metric]:
    """Every labelled sample of the engine's metrics in ``registry`` now."""
    records: list[Metric] = []
    for family in registry.collect():
        if not family.name.startswith(PREFIXES):
            continue
        if family.type == "gauge":
            records += [Gauge(family.name, s.labels, s.value) for s in family.samples]
        elif family.type == "counter":
            totals = [s for s in family.samples if s.name.endswith("_total")]
            if totals and "position" in totals[0].labels:
                records += _vectors(family.name, totals)
            else:
                records += [Counter(family.name, s.labels, int(s.value)) for s in totals]
        elif family.type == "histogram":
            records += _histograms(family)
    return records


def _vectors(name: str, samples) -> list[Vector]:
    by_labels: dict[tuple, dict[int, int]] = {}
    for s in samples:
        rest = tuple(sorted((k, v) for k, v in s.labels.items() if k != "position"))
        by_labels.setdefault(rest, {})[int(s.labels["position"])] = int(s.value)
    return [Vector(name, dict(rest), [values[p] for p in sorted(values)])
            for rest, values in by_labels.items()]


def _histograms(family) -> list[Histogram]:
    by_labels: dict[tuple, Histogram] = {}
    for s in family.samples:
        rest = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
        h = by_labels.setdefault(rest, Histogram(family.name, dict(rest), 0, 0.0, {}))
        if s.name.endswith("_bucket"):
            h.buckets[s.labels["le"]] = int(s.value)
        elif s.name.endswith("_count"):
            h.count = int(s.value)
        elif s.name.endswith("_sum"):
            h.sum = s.value
    return list(by_labels.values())
