"""raysgd.logs' levels in one process (no Ray): numbers in any form, and what the driver hands its workers.

The console's handling of the records is tested with real scripts in tests/api/test_console_logs.py.
"""
import logging

import numpy as np
import pytest

from raysgd import logs


@pytest.fixture
def restore_levels(monkeypatch):
    """Unset raysgd's level variables and put the levels back after the test."""
    for name in logs.FORWARDED_ENV:
        monkeypatch.delenv(name, raising=False)
    level = logging.getLogger("raysgd").level
    yield
    logs.set_log_level("INFO")
    logging.getLogger("raysgd").setLevel(level)


def test_a_level_is_a_name_or_a_number_in_any_form():
    assert logs.parse_level(np.int64(30)) == logging.WARNING and type(logs.parse_level(np.int64(30))) is int
    assert logs.parse_level("15") == 15 and logs.parse_level(" 25 ") == 25  # as RAYSGD_LOG_LEVEL takes it
    for bad in ("loud", "", 20.5, True, None):
        with pytest.raises(ValueError, match=r"set_log_level\(level\) expects a level name .* or a number; got"):
            logs.parse_level(bad)


def test_a_numeric_level_reaches_the_workers_and_can_be_put_back(restore_levels):
    logs.set_log_level(15, workers=5)
    assert logging.getLogger("raysgd").level == 15
    levels = logs.current_levels()
    assert levels == ("15", "5")
    forwarded = logs.forwarded_env()
    assert forwarded == {"RAYSGD_LOG_LEVEL": "15", "RAYSGD_WORKER_LOG_LEVEL": "5"}
    logs.as_worker(forwarded)  # what each worker actor does when it starts: it raised ValueError
    assert logging.getLogger("raysgd").level == 5
    logs.set_log_level("ERROR")
    logs.set_log_level(*levels)  # raysgd.train puts the levels back this way after a run
    assert logs.current_levels() == ("15", "5")


def test_a_bad_level_handed_to_a_worker_is_logged_not_raised(restore_levels, monkeypatch, caplog):
    monkeypatch.setenv("RAYSGD_WORKER_LOG_LEVEL", "verbose")  # the driver does not read it: it hands it on
    forwarded = logs.forwarded_env()
    assert forwarded == {"RAYSGD_WORKER_LOG_LEVEL": "verbose"}
    monkeypatch.delenv("RAYSGD_WORKER_LOG_LEVEL")
    with caplog.at_level(logging.WARNING, logger="raysgd"):
        logs.as_worker(forwarded)  # every worker failed to start
        assert logging.getLogger("raysgd").level == logging.WARNING
    assert ("the environment variable RAYSGD_WORKER_LOG_LEVEL expects a level name (DEBUG, INFO, WARNING, ERROR, "
            "CRITICAL, OFF) or a number; got 'verbose'; using WARNING") in caplog.text
