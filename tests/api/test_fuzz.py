"""Property-based fuzzing of every route in ``/openapi.json`` with schemathesis.

Requests that fit the schema and requests that break it, with the key, on the guarded server:
no answer may be a 5xx, each must match the schema (errors: OpenAI's shape) with a declared
content type, schema-breaking bodies must be refused, and every route but the open ones must
refuse a request without the key. ``FUZZ_EXAMPLES`` requests in all (and a few more, sent by
the checks themselves).
"""

from __future__ import annotations

import httpx
import schemathesis
from conftest import API_KEY
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, ignored_auth,
                                               negative_data_rejection,
                                               response_schema_conformance,
                                               status_code_conformance)

FUZZ_EXAMPLES = 1200
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance, negative_data_rejection, ignored_auth]


def test_fuzz_every_route(guarded):
    schema = schemathesis.openapi.from_url(guarded + "/openapi.json")
    strategy = (schema.as_strategy(schemathesis.GenerationMode.POSITIVE)
                | schema.as_strategy(schemathesis.GenerationMode.NEGATIVE))
    statuses: dict[int, int] = {}
    headers = {"Authorization": f"Bearer {API_KEY}"}

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck), phases=["explicit", "generate"])
    @given(case=strategy)
    def fuzz(case):
        response = case.call(base_url=guarded, headers=headers, timeout=60)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        case.validate_response(response, checks=CHECKS, headers=headers)

    fuzz()
    print(f"fuzzing: {sum(statuses.values())} requests, statuses {dict(sorted(statuses.items()))}")
    assert sum(statuses.values()) >= 1000
    assert not any(status >= 500 for status in statuses)
    assert statuses.get(200, 0) >= 100  # valid requests got through, not only refusals
    assert httpx.get(guarded + "/health").status_code == 200
