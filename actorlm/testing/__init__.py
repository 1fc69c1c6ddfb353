"""Test actorlm's actors one at a time or wired together, deterministically, without a model.

- ``TestProbe``: a real actor that stands in for any peer; ``expect_message`` / ``reply``.
- ``FakeModelRunner``: the model runner's contract with deterministic tokens, simulated
  latency, request failures and KV-bookkeeping checks.
- ``FaultInjector``: wraps any runner (real or fake) so that chosen steps raise, a worker's
  thread dies, or a poison request faults every step it is in. ``FakeRunnerFactory``: fake
  runners built in a worker process or Ray actor.
- ``ManualClock``: time that moves only when the test says so.
- ``EngineHarness``: the real actors around a fake runner, run one ``step()`` at a time.

See docs/testing.md.
"""

from actorlm.testing.clock import ManualClock
from actorlm.testing.fake_runner import FakeModelRunner, InjectedFault
from actorlm.testing.faults import FakeRunnerFactory, FaultInjector, InjectedDeath
from actorlm.testing.harness import EngineHarness
from actorlm.testing.records import RequestRecord, StepRecord
from actorlm.testing.probe import TestProbe
from actorlm.testing.tokenizer import ToyTokenizer

__all__ = ["TestProbe", "FakeModelRunner", "InjectedFault", "FaultInjector", "InjectedDeath",
           "FakeRunnerFactory",
           "ManualClock", "EngineHarness", "RequestRecord", "StepRecord", "ToyTokenizer"]
