"""Abuse in the suite, bounded: an abort storm and a soak on the guarded server (the long soak:
``python -m actorlm.bench.abuse --soak``). Figures: docs/reliability.md."""

from __future__ import annotations

from api_helpers import SERVED_NAME
from conftest import API_KEY

from actorlm.bench.abuse import abort_storm, soak

AUTH = {"Authorization": f"Bearer {API_KEY}"}
# a fresh server's first thousands of requests grow it by up to ~100 KiB each, natively (the
# Python heap stays flat): mostly oneDNN's primitive cache, 1024 shapes at most
# (docs/reliability.md). A leak above ~128 KiB per request breaks the bound.
MAX_RSS_GROWTH_MB = 256


def test_abort_storm_leaves_nothing_behind(guarded):
    result = abort_storm(guarded, 300, headers=AUTH, model=SERVED_NAME, max_tokens=32)
    print("abort storm:", result)
    assert result["num_other"] == 0  # every stream either finished or was hung up on
    assert result["num_hung_up"] >= 100 and result["num_finished"] >= 100
    assert result["idle"], result
    assert (result["num_running"], result["num_waiting"], result["kv_cache_usage"]) == (0, 0, 0)
    assert result["health"] == 200


def test_soak_keeps_memory_bounded(guarded):
    result = soak(guarded, 2000, headers=AUTH, model=SERVED_NAME)
    print("soak:", result)
    assert result["num_failed"] == 0, result["first_failure"]
    assert result["rss_growth_mb"] < MAX_RSS_GROWTH_MB, result
