"""LeastLoaded, the data-parallel balancer: vLLM's ``4 * waiting + running`` rule, with the
live sequences counted on the frontend's side."""

from __future__ import annotations

from actorlm.engine_core.balancer import LeastLoaded


def test_a_new_request_goes_to_the_replica_with_fewest_live_sequences():
    balancer = LeastLoaded(3)
    assert [balancer.assign([f"r{i}"]) for i in range(6)] == [0, 1, 2, 0, 1, 2]
    balancer.finished("r4")  # replica 1 now runs one fewer
    assert balancer.assign(["r6"]) == 1


def test_a_waiting_request_weighs_four_running_ones():
    balancer = LeastLoaded(2)
    for i in range(3):  # replica 0: three running
        balancer.assign([f"a{i}"])
        balancer.assign([f"pad{i}"])
    for i in range(3):
        balancer.finished(f"pad{i}")
    balancer.assign(["b"])  # replica 1: one live ...
    balancer.report(1, 1)  # ... and it is waiting: 1 + 3 * 1 = 4 > 3
    assert balancer.assign(["c"]) == 0
    balancer.report(1, 0)  # it runs: 1 < 4
    assert balancer.assign(["d"]) == 1


def test_a_requests_children_go_together_and_each_leaves_when_it_finishes():
    balancer = LeastLoaded(2)
    assert balancer.assign(["0_r", "1_r", "2_r"]) == 0
    assert balancer.live(0) == 3 and balancer.assign(["s"]) == 1
    assert balancer.by_owner(["1_r", "s", "gone"]) == {0: ["1_r"], 1: ["s"]}
    balancer.finished("0_r")
    balancer.finished("0_r")  # reported twice: counted once
    assert balancer.live(0) == 2 and balancer.owned_by(0) == {"1_r", "2_r"}
    assert balancer.num_assigned == [1, 1]
