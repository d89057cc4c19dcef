"""The failure policy (retry or raise, and the backoff before a restart): pure values, no cluster."""
from raysgd.torch.fault_tolerance import failure_policy as fp
from raysgd.torch.fault_tolerance import recovery


def test_an_unlimited_run_failing_again_and_again_keeps_waiting_the_cap():
    # FailureConfig(max_failures=-1): a function that fails at once on every start; its thousandth-and-more failure
    # in a row raised OverflowError (2 ** n as a float) instead of waiting the cap
    limits, counts = fp.FailureLimits(max_failures=fp.UNLIMITED, retry_user_errors=True, cap_s=60.0), fp.Counts()
    for _ in range(1100):
        decision = fp.decide(fp.USER_ERROR, counts, limits)
        counts = decision.counts
    assert (decision.action, decision.delay_s, counts.in_a_row) == (fp.RESTART, 60.0, 1100)
    assert fp.backoff_s(10 ** 6, base_s=0.0) == 0.0
    assert list(recovery.backoff_delays(tries=1100, base_s=1.0, cap_s=60.0))[-1] == 60.0


def test_the_backoff_starts_again_after_an_attempt_that_made_progress():
    limits = fp.FailureLimits(max_failures=fp.UNLIMITED, base_s=1.0, cap_s=4.0)
    delays, counts = [], fp.Counts()
    for progressed in (False, False, False, False, False, True, False):
        decision = fp.decide(fp.FAILURE, counts, limits, progressed=progressed)
        delays.append(decision.delay_s)
        counts = decision.counts
    assert delays == [0.0, 1.0, 2.0, 4.0, 4.0, 0.0, 1.0]
    assert counts.failures == 7


def test_max_retries_zero_raises_at_the_first_failure_and_n_allows_n():
    assert fp.decide(fp.FAILURE, fp.Counts(), fp.FailureLimits(max_failures=0)).gave_up
    counts, limits = fp.Counts(), fp.FailureLimits(max_failures=2)
    for retry in (1, 2):
        decision = fp.decide(fp.FAILURE, counts, limits)
        assert (decision.action, decision.retry) == (fp.RESTART, retry)
        counts = decision.counts
    assert fp.decide(fp.FAILURE, counts, limits).gave_up


def test_both_apis_backoff_is_capped_by_sgd_backoff_cap_s(monkeypatch):
    # raysgd.train's fit() made its limits without a cap, so it waited up to 60 s whatever SGD_BACKOFF_CAP_S said
    monkeypatch.setenv("SGD_BACKOFF_CAP_S", "5")
    limits = fp.FailureLimits(max_failures=-1, retry_user_errors=True, max_preemptions=-1)  # as fit() makes them
    assert limits.cap_s == 5.0
    assert fp.decide(fp.FAILURE, fp.Counts(in_a_row=20), limits).delay_s == 5.0
    monkeypatch.delenv("SGD_BACKOFF_CAP_S")
    assert fp.FailureLimits().cap_s == 60.0
