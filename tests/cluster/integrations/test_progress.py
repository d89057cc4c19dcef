"""use_tqdm: the rank-0 reporter (rate limit, description, running loss) and the bar on the driver's stderr."""
import io
import sys
import time

import pytest

from conftest import assert_released
from helpers import LinearOperator
from raysgd import TorchTrainer
from raysgd.torch.integrations.progress import ProgressBar, ProgressReporter, describe


class _Operator:
    """Stands in for an operator: the reporter only sets and clears ``progress_reporter`` on it."""

    progress_reporter = None


def test_describe_matches_1x():
    assert describe({"epoch_idx": 2, "num_epochs": 10}) == "3/10e"
    assert describe({"epoch_idx": 0}) == "1e"
    assert describe({}) == "1e"


def test_reporter_is_rate_limited_and_always_sends_the_end():
    sent = []
    reporter = ProgressReporter(lambda state, final: sent.append((state, final)), call_id=3, interval_s=0.05)
    operator = _Operator()
    with reporter.attach(operator, num_steps=None, source=range(400)):
        assert operator.progress_reporter is reporter
        start = time.monotonic()
        for batch_idx in range(400):
            reporter(batch_idx, {"train_loss": float(batch_idx % 2), "loss_g": 2.0, "acc": 0.5},
                     {"epoch_idx": 4, "num_epochs": 9})
            time.sleep(0.0005)
        elapsed = time.monotonic() - start
    assert operator.progress_reporter is None
    assert sent[0][0]["n"] == 1 and not sent[0][1]  # the first batch shows at once
    last, final = sent[-1]
    assert final and [f for _, f in sent].count(True) == 1
    assert last == {**last, "call": 3, "n": 400, "total": 400, "desc": "5/9e", "losses": {"loss": 0.5, "loss_g": 2.0}}
    assert len(sent) <= 2 + elapsed / 0.05  # about one update per interval, not one per batch
    assert len(sent) < 100


def test_reporter_total_is_num_steps_or_the_loader_length():
    states = []
    reporter = ProgressReporter(lambda state, final: states.append(state), call_id=1, interval_s=60)
    with reporter.attach(_Operator(), num_steps=7, source=range(100)):
        pass
    with reporter.attach(_Operator(), num_steps=None, source=iter(range(3))):  # no length: unknown
        pass
    assert [s["total"] for s in states] == [7, None]


def test_bar_shows_local_updates_and_ignores_stale_calls():
    out = io.StringIO()
    bar = ProgressBar(file=out)
    old = bar.start(local=True)
    reporter = bar.start(local=True)  # a second call: the first one's updates are stale
    old.begin(total=5)
    old(0, {"train_loss": 9.0}, {"epoch_idx": 7})
    assert bar.last_state is None
    reporter.begin(total=5)
    for batch_idx in range(5):
        reporter(batch_idx, {"train_loss": 0.25}, {"epoch_idx": 1, "num_epochs": 3})
    reporter.end()
    bar.finish()
    text = out.getvalue()
    assert "2/3e" in text and "5/5" in text and "loss=0.25" in text and "8e" not in text
    assert bar.last_state["n"] == 5


def test_use_tqdm_without_tqdm_is_a_value_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm now raises ImportError
    with pytest.raises(ValueError, match=r'use_tqdm=True\) needs tqdm, .*pip install "raysgd\[tqdm\]"'):
        TorchTrainer(training_operator_cls=LinearOperator, use_tqdm=True)


class ReportingOperator(LinearOperator):
    """LinearOperator whose batches say whether this rank got a progress reporter, and take a little time."""

    def train_batch(self, batch, batch_info):
        time.sleep(0.004)
        metrics = super().train_batch(batch, batch_info)
        metrics["has_reporter"] = float(getattr(self, "progress_reporter", None) is not None)
        return metrics


@pytest.mark.parametrize("use_local", [False, True], ids=["rank0-actor", "rank0-local"])
def test_one_bar_on_driver_stderr_fed_by_rank0(ray_2cpus, capfd, use_local):
    trainer = TorchTrainer(training_operator_cls=ReportingOperator, num_workers=2, use_local=use_local,
                           use_tqdm=True, timeout_s=60, config={"data_size": 400, "batch_size": 2})
    try:
        per_worker = [trainer.train(info={"num_epochs": 3}, reduce_results=False) for _ in range(2)]
        state = trainer.progress_bar.last_state
        time.sleep(0.5)  # let Ray forward anything the workers printed
    finally:
        trainer.shutdown()
    assert_released()  # the mailbox actor is gone with the trainer
    out, err = capfd.readouterr()
    assert [w["has_reporter"] for w in per_worker[-1]] == [1.0, 0.0]  # rank 0 only
    batches = per_worker[-1][0]["batch_count"]
    assert batches == 100
    assert state["desc"] == "2/3e" and state["n"] == state["total"] == batches
    assert 1 <= state["pushes"] <= 20  # rate-limited: not one update per batch
    assert "1/3e" in err and "2/3e" in err and f"{batches}/{batches}" in err and "loss=" in err
    assert "batch/s" not in out  # the bar is on stderr
    worker_lines = [line for line in (out + err).splitlines() if "TorchWorker" in line]
    assert not [line for line in worker_lines if "batch" in line or "3e" in line], worker_lines
