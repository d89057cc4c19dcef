"""Resuming inside an epoch, in-process (no Ray): a loaded cursor that waits for its epoch, the committed metrics
it carries, a loader that cannot apply it, and loops that stop early (what the cursor counts)."""
import pytest
import torch

from helpers import CountingOperator
from raysgd.meters import merge_partial
from raysgd.torch.state import checkpoint
from raysgd.torch.state import training_state as state
from raysgd.torch.commits.committer import CommitPlan
from raysgd.torch.execution.worker import TorchWorker

N, BATCH = 12, 2  # one worker: 6 batches an epoch


def make(operator=CountingOperator, add_dist_sampler=True, **config):
    worker = TorchWorker(operator, {"n": N, "batch_size": BATCH, **config}, is_local=True,
                         add_dist_sampler=add_dist_sampler)
    worker.setup_operator()
    return worker


def counts(worker):
    return worker.operator.model.p.detach().clone()


def weights(worker):
    return [p.detach().clone() for p in worker.operator.model.parameters()]


def a_commit(call="another-run/1"):
    """A commit of epoch 1 at cursor 6 (3 batches), with its own torch stream and committed metrics."""
    saved = make().state_dict()
    torch.manual_seed(77)
    committed_rng = state.rng_state()
    meters = [{"batch_count": 3, "num_samples": 6, "train_loss": 3.0, "last_train_loss": 2.0}]
    cursor = {"epoch": 1, "consumed": 6, "steps": 3, "call_steps": 3, "attempt": 0, "call": call}
    return {**saved, "epoch": 1, "cursor": cursor, "rng": [committed_rng], "meters": meters}


def roundtrip(value):
    return checkpoint.state_from_bytes(checkpoint.state_to_bytes(value))


def test_a_state_read_while_a_loaded_cursor_waits_carries_its_cursor_streams_and_metrics():
    """``load_state_dict(commit)`` then a call that trains nothing (a resumed ``train(num_steps=k)`` whose k steps
    were all committed), ``validate()`` or ``save()``: the state read then must resume where the commit does, with
    its random streams; it used to hold no cursor, so a restart from it trained the committed part twice."""
    commit = a_commit()
    worker = make()
    worker.load_state_dict(roundtrip(commit))
    assert worker.train_epoch(num_steps=0)["epoch"] == 1  # the commit's epoch, as the commit counted it
    torch.manual_seed(5)  # the process's streams move on meanwhile (validation, user code)
    carried = roundtrip(worker.state_dict())
    assert carried["cursor"] == commit["cursor"] and carried["epoch"] == 1
    assert carried["rng"] == commit["rng"] and carried["meters"] == commit["meters"]
    assert worker.rng_state() == commit["rng"][0]

    restarted = make()
    restarted.load_state_dict(carried)
    expected, got = worker.train_epoch(), restarted.train_epoch()
    assert torch.equal(counts(worker), counts(restarted))  # the same 6 samples after the cursor, once
    assert int(counts(restarted).sum()) == N - 6 and set(counts(restarted).tolist()) == {0.0, 1.0}
    assert all(torch.equal(a, b) for a, b in zip(weights(worker), weights(restarted)))  # dropout streams too
    assert got == expected
    assert restarted.state_dict().get("cursor") is None  # applied: the epoch is over


def test_the_call_that_resumes_a_loaded_commit_reports_the_whole_epoch():
    """The committed part's metrics travel in the commit (``meters``): the call that resumes it reports the epoch
    (they used to be ignored: num_samples 6 of 12)."""
    commit = a_commit()
    worker, without = make(), make()
    worker.load_state_dict(commit)
    without.load_state_dict({**commit, "meters": None})
    stats, rest = worker.train_epoch(), without.train_epoch()
    assert rest["num_samples"] == 6 and stats["num_samples"] == N and stats["batch_count"] == 6
    assert stats == {"epoch": 1, **merge_partial(commit["meters"][0], rest)}
    assert stats["train_loss"] == pytest.approx((3.0 * 6 + rest["train_loss"] * 6) / N)
    assert worker.train_epoch()["num_samples"] == N  # merged once: the next epoch reports itself


class _Sink:
    def __init__(self):
        self.records = []

    def put(self, key, rank, world_size, blob, state=None):
        self.records.append(checkpoint.state_from_bytes(blob))


@pytest.mark.parametrize("same_call", [False, True], ids=["loaded-by-the-user", "retry-of-its-own-call"])
def test_committed_metrics_are_merged_once_on_the_worker_or_by_the_driver(same_call):
    """A commit of another call (``load_state_dict``, a durable resume) is merged by the worker, into the call's
    result and into its commits; a retry inside the commit's own call is merged by the driver
    (:class:`raysgd.torch.commits.commit_policy.CommitPolicy`), so the worker must not add it a second time."""
    plan = CommitPlan(_Sink(), every_n=1, interval_s=30, call_id=1, attempt=1, run_id="this-run")
    worker = make()
    worker.load_state_dict(a_commit(call=plan.call_tag if same_call else "another-run/1"))
    stats = worker.train_epoch(commit=plan)
    worker.committer.flush(timeout_s=30)
    loaded = 0 if same_call else 6
    assert stats["num_samples"] == loaded + 6
    assert [r["meters"]["num_samples"] for r in plan.sink.records] == [loaded + 2, loaded + 4, loaded + 6]


def test_a_loaded_cursor_the_train_loader_cannot_apply_is_an_error():
    """A loader without a cursor (here not sharded: add_dist_sampler=False, a plain shuffled loader) cannot start at
    the loaded cursor; replaying the epoch from its start would train its committed part twice."""
    worker = make(add_dist_sampler=False)
    worker.load_state_dict(a_commit())
    with pytest.raises(ValueError, match=r"resumes epoch 1 at data cursor 6 .* has no data cursor"):
        worker.train_epoch()
    assert int(counts(worker).sum()) == 0  # nothing trained
    with pytest.raises(ValueError, match=r"train\(dataset=\.\.\.\) cannot run while a loaded state waits"):
        worker.train_epoch(iterator=iter([]))
    assert worker.state_dict()["cursor"]["consumed"] == 6  # still waiting: the error changed nothing


class StopsAfterThree(CountingOperator):
    """A custom loop that trains three batches and stops (``break`` after training the third)."""

    def train_epoch(self, iterator, info=None):
        for index, batch in enumerate(iterator):
            self.train_batch(batch, {"batch_idx": index})
            if index == 2:
                break
        return {}


def test_a_loop_that_stops_early_is_past_the_batch_it_took_and_so_is_the_cursor():
    """The iterator the loop broke out of has handed out its third batch: the live worker goes on after it, so
    the cursor must count it too (it counted 2 batches, and a restart from it trained the third batch again)."""
    live = make(StopsAfterThree)
    live.train_epoch()
    saved = roundtrip(live.state_dict())
    assert saved["cursor"]["consumed"] == 3 * BATCH
    restarted = make(StopsAfterThree)
    restarted.load_state_dict(saved)
    live.train_epoch()
    restarted.train_epoch()
    assert torch.equal(counts(live), torch.ones(N)) and torch.equal(counts(restarted), counts(live))


@pytest.mark.parametrize("own_sampler", [False, True], ids=["sharded", "own-sampler"])
def test_a_loader_reading_out_of_order_has_no_cursor_unless_raysgd_puts_it_in_order(own_sampler):
    """``DataLoader(num_workers=2, in_order=False)``: its batches come as its processes finish them, so the first k
    batches are not the first k of the sampler's order. raysgd's training shard reads in order; a loader of the
    user's own sampler that reads out of order has no cursor (it had one, counting the wrong samples)."""
    worker = make(own_sampler=own_sampler, add_dist_sampler=not own_sampler, loader_workers=2, in_order=False)
    try:
        worker.train_epoch(num_steps=2)
        cursor = worker.state_dict().get("cursor")
        if own_sampler:
            assert cursor is None
            return
        loader = worker.operator._train_loader
        assert loader.in_order is True and cursor["consumed"] == 2 * BATCH
        first = loader.sampler.stream()[:2 * BATCH]
        assert torch.nonzero(counts(worker)).flatten().tolist() == sorted(first)
    finally:
        worker.shutdown()  # its loader's processes end now, not whenever pytest collects the iterator
