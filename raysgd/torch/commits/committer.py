"""Taking commits inside an epoch: count the batches a worker pulls, commit between two of them, resume.

Layer 4 (layers 0-3, no Ray). The worker wraps the batches it hands to the operator with
:meth:`Committer.batches`; the operator's loop (the default one or a custom one) finishes a batch
before it pulls the next, so a commit taken at the pull holds a consistent state. The training loop
pays one serialisation of the state (``torch.save`` of the live tensors into a buffer: no separate host copy);
the transfer runs in a background thread and hands the buffer over without copying it, so a commit holds at most
one serialised copy of the state besides the live one (and the transport's, in Ray's object store).

When to commit: every ``every_n`` steps of the epoch, or, for a time interval, once the training time since
the call's start or its last commit reaches ``interval_s``. That time is counted from what every rank
measured in its steps, exchanged at every step boundary with the preemption agreement (its ``all_reduce``
also takes the maximum of each rank's time: :func:`raysgd.torch.commits.preemption.exchange`), so every rank adds the
same numbers and commits at the same step: the commit is one global point. Nothing is extrapolated from
the first steps, so a slow warm-up (compilation, autotuning) only makes the first commit come after fewer
steps, and a later change of speed is followed at once.

Each rank sends ``{"rng", "meters", "cursor"}`` and rank 0 also, apart, the state (models, optimizers...) to
the plan's ``sink`` (an object with ``put(key, rank, world_size, blob, state)``; the trainer's store). A
commit is complete once every rank of the group has put its record under the same key.

Example:
    >>> commit_due(every_n=10, epoch_steps=20, interval_s=30, trained_s=0.0)
    True
    >>> commit_due(every_n=None, epoch_steps=7, interval_s=30, trained_s=29.5)
    False
"""
import logging
import threading
import time
from typing import cast

from raysgd.meters import merge_partial
from raysgd.torch.sharding import loaders as _data
from raysgd.torch.commits import preemption
from raysgd.torch.sharding.cursor import DataCursor
from raysgd.torch.state import training_state as _state
from raysgd.torch.state.checkpoint import serialise
from raysgd.torch.commits.commit_stats import process_stats

logger = logging.getLogger(__name__)

#: The key of rank 0's record holding a sharded commit's head: the rest of the state and the parts' DCP metadata.
HEAD = "head"


def commit_due(every_n, epoch_steps, interval_s, trained_s):
    """Whether a commit is due now: every ``every_n`` steps of the epoch, or (``every_n=None``) once the agreed
    training time since the last restart point, ``trained_s``, reached ``interval_s``."""
    if every_n:
        return epoch_steps % int(every_n) == 0
    return trained_s >= interval_s


class CommitPlan:
    """How one ``train()`` call commits; built by the trainer and sent with the call to every worker.

    Args:
        sink: where the records go (``put(key, rank, world_size, blob)``; blocking).
        every_n: commit every that many steps; None: about every ``interval_s`` seconds.
        call_id, attempt: identify the call and the attempt within it (keys and merging of metrics).
    """

    def __init__(self, sink, every_n, interval_s, call_id, attempt=0, run_id=""):
        self.sink, self.every_n, self.interval_s = sink, every_n, interval_s
        self.call_id, self.attempt = call_id, attempt
        self.call_tag = f"{run_id}/{call_id}"  # which trainer's which call a commit's cursor belongs to

    def continues(self, cursor):
        """Whether a loaded commit's ``cursor`` was taken in this very call (a retry or a resize inside it), so
        its ``call_steps`` go on; a commit of another call or trainer (``load_state_dict``, a durable resume)
        starts the call's step count at 0."""
        return cursor is not None and cursor.get("call") == self.call_tag


def _cursor_of(loader, batches_taken):
    """The global cursor after ``batches_taken`` batches of ``loader`` (:func:`raysgd.torch.sharding.loaders.loader_cursor`)."""
    return _data.loader_cursor(loader, batches_taken) if loader is not None else None


def _positions_tag(loader):
    """``{"positions": n}``, the length of ``loader``'s epoch stream, for a cursor taken on it (empty when unknown):
    a resume checks it (:meth:`Committer.begin_epoch`)."""
    positions = _data.cursor_positions(loader) if loader is not None else None
    return {} if positions is None else {"positions": int(positions)}


def set_start(loader, consumed):
    """Start ``loader``'s epoch at global cursor ``consumed``; False when the loader cannot (no cursor)."""
    return _data.set_sampler_start(loader, consumed)


class Committer:
    """One worker's commit bookkeeping: step counters, the agreed cadence, the background sender, resume; its
    timings go to ``stats`` (default: the process's, :func:`process_stats`)."""

    def __init__(self, stats=None):
        self.stats = process_stats() if stats is None else stats
        self.epoch_steps = 0  # batches of the running epoch (counting those before a resume)
        self.iter_batches = 0  # batches pulled from the running epoch's iterator
        self.call_steps = 0
        # {"cursor", "rng", "meters", "share"} of a loaded state, applied at the next epoch start
        self.resume: dict | None = None
        self.carried = None  # this rank's share of the loaded committed metrics, merged into the running call's
        self._trained_s = 0.0  # agreed training time since the call's start or its last commit
        self._unsent_s = 0.0  # this rank's step time not yet exchanged
        self._thread = None
        self._warned = False
        self._due = False  # a commit is due at the next optimizer-step boundary
        self.sent = 0

    # ----------------------------------------------------------------- epochs
    def begin_epoch(self, loader):
        """At a new epoch's start: apply a pending resume (start at its cursor) or start at 0.

        A loader that cannot start at the loaded cursor raises ``ValueError``: replaying the epoch from its
        start would train its committed part twice.
        """
        self.iter_batches = 0
        if self.resume is None:
            set_start(loader, 0)
            self.epoch_steps = 0
            return
        cursor = self.resume["cursor"]
        if not set_start(loader, self._start_of(cursor, loader)):
            raise ValueError(
                f"The loaded state resumes epoch {cursor['epoch']} at data cursor {cursor['consumed']} (positions of "
                f"the epoch's order already trained), but the train loader ({type(loader).__name__}) has no data "
                "cursor to start there (an iterable dataset, a loader raysgd does not shard, or a sampler read "
                "lazily): starting the epoch from its beginning would train its committed part twice. Load the "
                "state into a trainer whose train loader has a cursor (as the one it was taken with), or drop the "
                "cursor to train that epoch again from its start: state.pop('cursor'); state['epoch'] -= 1")
        self.epoch_steps = cursor["steps"]

    def _start_of(self, cursor, loader):
        """Where the loaded ``cursor`` starts ``loader``'s epoch (:func:`~raysgd.torch.sharding.loaders.resumed_start`:
        the same share of a stream of another length; rank 0 logs it)."""
        return _data.resumed_start(loader, cursor["consumed"], cursor.get("positions"),
                                   warn=cast(dict, self.resume).get("rank", 0) == 0)

    def after_iter(self):
        """Just after the epoch's iterator was made (it draws from torch's stream): restore the loaded streams and
        carry the loaded committed metrics into this call's."""
        if self.resume is not None:
            _state.RANDOM_STREAMS.load_state_dict(self.resume["rng"])
            self.carried = self.resume["share"]
            self.resume = None

    def pending_state(self):
        """The keys a state read now must hold while a loaded resume waits for its epoch (``cursor``, ``meters``),
        else None: a snapshot, ``save()`` or ``state_dict()`` taken before the epoch starts resumes the same way."""
        if self.resume is None:
            return None
        meters = self.resume["meters"]
        return {_state.CURSOR: dict(self.resume["cursor"]), **({_state.METERS: meters} if meters else {})}

    def pending_rng(self):
        """This rank's random streams of a loaded resume still waiting (they apply at its epoch's start), else None."""
        return self.resume["rng"] if self.resume is not None else None

    def merge_carried(self, stats):
        """``stats`` of the call that resumed a loaded state, with the loaded committed metrics merged in (once)."""
        carried, self.carried = self.carried, None
        return merge_partial(carried, stats) if carried else stats

    def cursor_now(self, epochs, loader):
        """The cursor of an epoch stopped between calls (``train(num_steps=...)``), or None (none, or no cursor)."""
        consumed = _cursor_of(loader, self.iter_batches) if loader is not None else None
        if consumed is None:
            return None
        return DataCursor(epochs, int(consumed), self.epoch_steps, **_positions_tag(loader)).state_dict()

    def load(self, cursor, rng, meters=None, rank=0, world_size=1):
        """Remember a loaded commit: the next epoch starts at its cursor with its random streams, and the call that
        resumes it reports its committed metrics too (``meters``: per rank of the group that committed)."""
        self.resume = {"cursor": DataCursor.of(cursor).state_dict(), "rng": rng, "meters": list(meters) if meters else None,
                       "share": _state.meters_share(meters, rank, world_size), "rank": rank} if cursor else None
        self.carried = None
        if cursor is None and rng is not None:
            _state.RANDOM_STREAMS.load_state_dict(rng)

    # ----------------------------------------------------------------- the wrapped batches
    def batches(self, worker, batches, plan, loader_of):
        """Yield ``batches``; between two of them count the step and commit when due (``plan`` may be None)."""
        cursor = self.resume["cursor"] if self.resume else None
        continues = plan is not None and plan.continues(cursor)
        self.call_steps = cast(dict, cursor).get("call_steps", 0) if continues else 0  # continues: cursor is set
        if continues:  # a retry inside its own call: the driver merges the committed metrics (raysgd.torch.commits.commit_policy)
            cast(dict, self.resume).update(meters=None, share=None)
        preemption.set_active(plan is not None)  # a SIGTERM now commits at the next step (raysgd.torch.commits.preemption)
        check_every = preemption.check_every()
        self._trained_s = self._unsent_s = 0.0  # the call's start is a restart point
        try:
            for batch in batches:
                started = time.monotonic()
                try:
                    yield batch
                except GeneratorExit:  # the loop stopped after taking this batch: the epoch's iterator is past it
                    self._count()
                    raise
                self._unsent_s += time.monotonic() - started
                self._count()
                if plan is None:
                    continue
                boundary = worker.operator.at_step_boundary()  # grads aren't state: no mid-step commit
                if boundary and self.call_steps % check_every == 0:
                    level, slowest_s = preemption.exchange(worker, resize=self._resize(plan), trained_s=self._unsent_s)
                    self._unsent_s, self._trained_s = 0.0, self._trained_s + slowest_s
                    self._maybe_stop(worker, plan, loader_of(), level)
                self._due = self._due or commit_due(plan.every_n, self.epoch_steps, plan.interval_s, self._trained_s)
                if self._due and boundary:
                    self._due, self._trained_s = False, 0.0
                    self._commit(worker, plan, loader_of())
            if plan is not None and worker.operator.at_step_boundary():  # a signal in the last step
                level = preemption.agree(worker, last=True)
                self._maybe_stop(worker, plan, loader_of(), preemption.PREEMPT if level == preemption.PREEMPT else 0)
        finally:
            preemption.drop_pending()
            preemption.set_active(False)

    def _count(self):
        self.epoch_steps += 1
        self.iter_batches += 1
        self.call_steps += 1

    @staticmethod
    def _resize(plan):
        return preemption.resize_wanted(plan.call_id, plan.attempt)

    def _maybe_stop(self, worker, plan, loader, level):
        """A rank got SIGTERM, or the driver asked to stop (grow, leave a draining node): every rank commits here
        (a preemption commit marked so in the store first: :func:`raysgd.torch.commits.preemption.stopping`), waits until
        the store holds the whole commit (at most ``SGD_PREEMPT_COMMIT_S``; no grace timer cuts the send short),
        and ends the call (:func:`raysgd.torch.commits.preemption.leave`)."""
        if level == preemption.GO_ON:
            return
        deadline = preemption.stopping(level, plan.sink, (plan.call_id, plan.attempt, self.call_steps))
        key = self._commit(worker, plan, loader)
        self.flush(timeout_s=max(0.0, deadline - time.monotonic()))
        preemption.leave(worker, self.call_steps, level, plan.sink if key is not None else None, key, deadline)

    # ----------------------------------------------------------------- taking and sending
    def _commit(self, worker, plan, loader):
        """Take a commit and start sending it; returns its key, or None (no cursor: no commit)."""
        consumed = _cursor_of(loader, self.iter_batches) if loader is not None else None
        if consumed is None:
            if not self._warned:
                logger.warning("No commit inside this epoch: its input has no data cursor (iterable dataset, Ray "
                               "Data, a loader without a sharding sampler, or one reading out of order: "
                               "num_workers > 0 with in_order=False); a failure replays the epoch.")
                self._warned = True
            return None
        started = time.perf_counter()
        op = worker.operator
        partial = op.metrics_so_far()  # the epoch's metrics so far: a loaded committed part counts too
        meters = None if partial is None else merge_partial(self.carried, partial)
        record = {"rng": _state.RANDOM_STREAMS.state_dict(), "meters": meters,
                  "cursor": DataCursor(worker.epochs, int(consumed), self.epoch_steps, self.call_steps,
                                       attempt=plan.attempt, call=plan.call_tag, **_positions_tag(loader)).state_dict()}
        self.flush()  # at most one commit in flight: its buffer is gone before the next one is made
        key = (plan.call_id, plan.attempt, self.call_steps)  # records of one attempt only complete a commit
        try:
            # the live tensors, serialised now, in the loop, apart from the record (which stays small for the
            # driver): rank 0's whole state, or under a sharded strategy every rank's part (a collective) with the
            # rest of the state and the part's metadata in rank 0's record
            state = None
            if _state.is_sharded(op):
                from raysgd.torch.state import sharded  # noqa: PLC0415 (DCP's import: sharded strategies only)

                part = sharded.save_parts(_state.capture_shards(op))
                state = memoryview(part.blob).toreadonly()
                if worker.world_rank == 0:
                    record[HEAD] = bytes(serialise({"rest": _state.capture_rest(op, worker.epochs),
                                                    "metadata": part.metadata, "layout": part.layout}))
                del part
            elif worker.world_rank == 0:
                state = serialise(_state.capture(op, worker.epochs))
            blob = serialise(record)
        except Exception as err:  # noqa: BLE001 (as a failed send: a lost commit only costs recomputation)
            logger.warning("Commit %s of rank %d was not stored: %s", key, worker.world_rank, err)
            return key
        finally:
            del record
        self._thread = threading.Thread(target=self._send, args=(plan.sink, key, worker.world_rank,
                                                                 worker.world_size, blob, state, started), daemon=True)
        self._thread.start()
        self.stats.record_taken(key, time.perf_counter() - started)
        return key

    def _send(self, sink, key, rank, world_size, blob, state, started):
        try:
            sink.put(key, rank, world_size, blob, state)
            self.sent += 1
            size = blob.nbytes + (state.nbytes if state is not None else 0)
            self.stats.record_stored(time.perf_counter() - started, size)
        except Exception as err:  # noqa: BLE001 (a lost commit only costs recomputation)
            logger.warning("Commit %s of rank %d was not stored: %s", key, rank, err)

    def flush(self, timeout_s=None):
        """Wait for the commit in flight (if any) to be stored."""
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
