"""raysgd.base.environment's table of variables read in one process (no Ray): what each kind takes and refuses.

tests/repo/test_repository.py checks that the docs give the table and that every module reads through it.
"""
import threading

import pytest

from raysgd.base import environment


@pytest.mark.parametrize("text", ["inf", "Infinity", "1e300", "nan", "-1"])
def test_seconds_are_finite_so_no_wait_fails_late_with_them(monkeypatch, text):
    # "inf" was taken: ray.wait(timeout=inf) then raised OverflowError in a failure's path (SGD_SNAPSHOT_FINISH_S),
    # threading's waits "timestamp out of range"; now the variable is named when it is read
    monkeypatch.setenv("SGD_SNAPSHOT_FINISH_S", text)
    with pytest.raises(ValueError, match=r"^the environment variable SGD_SNAPSHOT_FINISH_S expects a number of "
                                         r"seconds >= 0 \(finite: at most 9223372036\); got"):
        environment.get("SGD_SNAPSHOT_FINISH_S")


def test_seconds_up_to_the_longest_wait_are_taken(monkeypatch):
    for text, value in [(" 2 ", 2.0), ("1.0", 1.0), ("0", 0.0), ("9e9", 9e9)]:
        monkeypatch.setenv("SGD_SNAPSHOT_FINISH_S", text)
        assert environment.get("SGD_SNAPSHOT_FINISH_S") == value
    assert threading.TIMEOUT_MAX >= 9e9  # a thread can wait that long


def test_counts_and_flags_take_their_usual_spellings(monkeypatch):
    for name, text, value in [("SGD_MAX_RESTART_TRIES", "1.0", 1), ("SGD_MAX_RESTART_TRIES", " 3 ", 3),
                              ("SGD_KEEP_SURVIVORS", " Yes ", True), ("SGD_KEEP_SURVIVORS", "OFF", False),
                              ("SGD_KEEP_SURVIVORS", "", True), ("RAYSGD_LOG_LEVEL", "warn", 30)]:
        monkeypatch.setenv(name, text)
        assert environment.get(name) == value, (name, text)
    for name, text in [("SGD_MAX_RESTART_TRIES", "0"), ("SGD_MAX_RESTART_TRIES", "inf"), ("SGD_KEEP_SURVIVORS", "2")]:
        monkeypatch.setenv(name, text)
        with pytest.raises(ValueError, match=f"^the environment variable {name} expects .*; got '{text}'$"):
            environment.get(name)
