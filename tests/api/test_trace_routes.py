"""The server's live trace: /trace.json carries the records, /trace renders them."""

import json

import httpx
from api_helpers import SERVED_NAME


def test_trace_json_and_page_show_a_served_request(server, client):
    done = client.completions.create(model=SERVED_NAME, prompt="hello trace", max_tokens=3,
                                     temperature=0)
    lines = httpx.get(server + "/trace.json", timeout=30).text.strip().splitlines()
    records = [json.loads(line) for line in lines]
    assert records[0]["kind"] == "config" and records[0]["max_num_batched_tokens"] > 0
    arrivals = [r for r in records if r["kind"] == "arrival" and r["num_prompt_tokens"] > 0]
    assert arrivals, "the request's arrival is recorded"
    finished = {r["request_id"] for r in records
                if r["kind"] == "transition" and r["target"] == "finished"}
    assert arrivals[-1]["request_id"] in finished
    assert done.choices[0].finish_reason == "length"
    page = httpx.get(server + "/trace", timeout=60)
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "data-request-id" in page.text
