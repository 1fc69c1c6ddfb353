"""Abuse in the suite, bounded: an abort storm and a soak on the guarded server (the long soak:
``python -m actorlm.bench.abuse --soak``). Figures: docs/reliability.md."""

from __future__ import annotations

from api_helpers import SERVED_NAME
from conftest import API_KEY

from actorlm.bench.abuse import abort_storm, soak

AUTH = {"Authorization": f"Bearer {API_KEY}"}
# the soak: after 500 requests of warm-up, 10,000 more grow no process of the server
# (the frontend's, the engine core's) by more than 64 MiB. The frontend's trace ring is what
# grows (about 0.5 KiB a record, ~5 records a request, 100,000 records at most).
MAX_RSS_GROWTH_MB = 64


def test_abort_storm_leaves_nothing_behind(guarded):
    result = abort_storm(guarded, 300, headers=AUTH, model=SERVED_NAME, max_tokens=32)
    print("abort storm:", result)
    assert result["num_other"] == 0  # every stream either finished or was hung up on
    assert result["num_hung_up"] >= 100 and result["num_finished"] >= 100
    assert result["idle"], result
    assert (result["num_running"], result["num_waiting"], result["kv_cache_usage"]) == (0, 0, 0)
    assert result["health"] == 200


def test_soak_keeps_every_process_within_64_mib(guarded):
    result = soak(guarded, 10_000, headers=AUTH, model=SERVED_NAME, num_warmup=500)
    print("soak:", result)
    assert result["num_failed"] == 0, result["first_failure"]
    assert result["max_rss_growth_mb"] < MAX_RSS_GROWTH_MB, result
