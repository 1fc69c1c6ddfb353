"""The waiting queue's order under each scheduling policy: arrivals, and requests put back
(preempted, or a child of n whose prompt is now cached)."""

import pytest

from actorlm.core.request import Request
from actorlm.core.waiting_queue import WaitingQueue, start_running
from actorlm.sampling_params import SamplingParams


def request(name: str, priority: int, arrival: float) -> Request:
    return Request(name, [1, 2, 3], SamplingParams(), 0, arrival, priority=priority)


def names(requests) -> str:
    return "".join(r.request_id for r in requests)


A, B, C, D = request("a", 0, 1.0), request("b", 1, 2.0), request("c", 0, 3.0), \
    request("d", -1, 4.0)


def test_fcfs_serves_arrivals_in_order_and_puts_a_request_back_in_front():
    queue = WaitingQueue("fcfs")
    for r in (A, B, C, D):
        queue.add(r)
    assert names(queue) == "abcd"
    queue.remove(C)  # admitted
    queue.put_back(C)  # and preempted: back in front of everyone
    assert names(queue) == "cabd"


def test_priority_orders_by_priority_then_arrival_and_puts_back_ahead_of_equals():
    queue = WaitingQueue("priority")
    for r in (A, B, C, D):
        queue.add(r)
    assert names(queue) == "dacb"
    queue.remove(C)  # admitted
    queue.add(request("e", 0, 3.0))  # C's key
    assert names(queue) == "daeb"
    queue.put_back(C)  # preempted: ahead of its equals, behind what outranks it
    assert names(queue) == "daceb"
    queue.add(request("f", 0, 3.0))  # a new arrival: behind its equals
    assert names(queue) == "dacefb"
    assert C in queue and len(queue) == 6


def test_running_keeps_the_policys_order_so_the_last_is_the_one_preempted():
    fcfs, by_priority = [], []
    for r in (B, A, D, C):  # admitted in this order
        start_running(fcfs, r, by_priority=False)
        start_running(by_priority, r, by_priority=True)
    assert names(fcfs) == "badc" and names(by_priority) == "dacb"


def test_an_unknown_policy_is_refused_by_name():
    with pytest.raises(ValueError, match="'sjf'.*fcfs, priority"):
        WaitingQueue("sjf")
