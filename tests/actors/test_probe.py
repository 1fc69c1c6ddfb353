"""TestProbe on its own: a real actor that records, matches and answers."""

import subprocess
import sys
import threading

import pykka
import pytest

from actorlm.testing import TestProbe


def test_probe_is_a_real_actor_and_records_in_order(make_probe):
    probe = make_probe("peer")
    assert isinstance(probe.ref, pykka.ActorRef) and probe.ref.is_alive()
    probe.ref.tell("one")
    probe.ref.tell(2)
    assert probe.expect_message(str) == "one"
    assert probe.expect_message(lambda m: m == 2) == 2
    probe.expect_no_message(0)
    assert probe.messages == ["one", 2]
    assert probe.received(int) == [2]


def test_a_message_is_recorded_as_soon_as_tell_returns(make_probe):
    probe = make_probe()
    probe.ref.tell("now")
    assert probe.receive_all() == ["now"]  # no waiting: recorded in the sender's thread


def test_expect_message_reports_a_mismatch_and_a_timeout(make_probe):
    probe = make_probe("allocator")
    probe.ref.tell("not an int")
    with pytest.raises(AssertionError, match="allocator: expected int, got 'not an int'"):
        probe.expect_message(int)
    with pytest.raises(AssertionError, match="got nothing"):
        probe.expect_message(int, timeout=0)


def test_expect_no_message_fails_on_an_unread_message(make_probe):
    probe = make_probe()
    probe.ref.tell("stray")
    with pytest.raises(AssertionError, match="stray"):
        probe.expect_no_message(0)


def test_expect_message_waits_for_a_message_sent_from_another_thread(make_probe):
    probe = make_probe()
    ready = threading.Event()

    def send():
        ready.wait()
        probe.ref.tell("late")

    sender = threading.Thread(target=send)
    sender.start()
    ready.set()
    assert probe.expect_message(str, timeout=5) == "late"
    sender.join()


def test_fish_for_message_skips_non_matching(make_probe):
    probe = make_probe()
    for message in ("a", 1, "b", 2.5):
        probe.ref.tell(message)
    assert probe.fish_for_message(float) == 2.5
    probe.expect_no_message(0)


def test_reply_answers_the_last_ask(make_probe):
    probe = make_probe()
    first = probe.ref.ask("first?", block=False)
    second = probe.ref.ask("second?", block=False)
    assert probe.num_pending_asks == 2
    assert probe.reply("answer 2") == "second?"
    assert second.get(timeout=1) == "answer 2"
    probe.reply(ValueError("no"))
    with pytest.raises(ValueError, match="no"):
        first.get(timeout=1)
    with pytest.raises(AssertionError, match="nobody asked"):
        probe.reply(1)


def test_stop_fails_pending_asks_and_refuses_new_messages():
    probe = TestProbe()
    pending = probe.ref.ask("hello?", block=False)
    probe.stop()
    with pytest.raises(pykka.ActorDeadError):
        pending.get(timeout=1)
    with pytest.raises(pykka.ActorDeadError):
        probe.ref.tell("after stop")


def test_pytest_does_not_mistake_the_probe_for_a_test_class(tmp_path):
    """A user's test module imports TestProbe: pytest must not try to collect it (its name
    starts with "Test"), which would warn about its constructor or run its methods."""
    module = tmp_path / "test_uses_probe.py"
    module.write_text("from actorlm.testing import TestProbe\n\n\ndef test_nothing():\n"
                      "    pass\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p",
                          "no:cacheprovider", str(module)], capture_output=True, text=True,
                         cwd=tmp_path, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "test_nothing" in run.stdout
    assert "TestProbe" not in run.stdout + run.stderr
