"""The driver's side of a training function's commits: each attempt's report plan, the checkpoint it starts from,
and the reports rank 0 makes while it runs.

Part of :mod:`raysgd.train`. :class:`ReportCommits` is to a training function what
:class:`~raysgd.torch.commits.commit_policy.CommitPolicy` is to an operator: the
:class:`~raysgd.torch.execution.controller.RunController` calls the same methods on it (``begin_call``,
``with_plan``, ``restart_state``, ``committed_this_attempt``, ``running_attempt``, ``finish``...). A function's
commits are the checkpoints it reports (:mod:`raysgd.train.reporting`), durable in the run's folder
(``storage_path/name``, a :class:`~raysgd.torch.storage.filesystem.CheckpointStorage` of reported checkpoints): an
attempt starts from the newest complete one whose files match its marker (sizes always, CRC-32 on a local folder;
a damaged one is skipped with a warning and the one before it used), or from ``resume_from_checkpoint`` when the
folder has none. While the function runs, :meth:`ReportCommits.poll` reads rank 0's reports (every rank's metrics,
the checkpoint) from its actor's ``"control"`` group, at the controller's ticks, and hands each to ``on_report``;
the checkpoints the retention policy does not keep are pruned then, by the driver.

Example:
    >>> import tempfile
    >>> from raysgd.torch.storage.filesystem import CheckpointStorage, REPORT_MARKER
    >>> commits = ReportCommits(CheckpointStorage(tempfile.mkdtemp(), None, marker=REPORT_MARKER), home=None)
    >>> commits.begin_call()
    >>> plan = commits.with_plan({})["plan"]
    >>> plan.first_index, plan.resume, commits.committed_this_attempt()
    (1, None, None)
"""
import logging
from typing import cast

from raysgd.torch.storage import filesystem, rank_files
from raysgd.train.reporting import ReportPlan

logger = logging.getLogger(__name__)


class ReportCommits:
    """A training function's commits (see the module docstring).

    Args:
        storage: the run folder's :class:`~raysgd.torch.storage.filesystem.CheckpointStorage` (``REPORT_MARKER``).
        home: the driver's node id when the folder is local (ranks on other nodes write through it), else None.
        initial: ``(uri, None)`` of ``resume_from_checkpoint`` when given: the start while the folder has none.
        on_report: ``on_report(record)`` for every report rank 0 made (its ``metrics`` per rank, ``checkpoint``).
        score_attribute: ``CheckpointConfig(checkpoint_score_attribute)``: the ranks refuse a checkpoint whose score
            is not a number before writing it.
        on_resume: ``on_resume(directory)`` when an attempt starts from a checkpoint of the run folder (the call's
            first, or one after a failure; before any of its reports; not for ``initial``): the driver-side
            components the checkpoint keeps are restored from it. ``on_resume(None)`` when an attempt after a
            failure starts from the call's beginning (no checkpoint of the run folder yet: from ``initial`` or
            from nothing): they go back to their start.
        checkpoint_config: the run's ``CheckpointConfig``, handed to the workers in each plan (the checkpoints
            ``get_all_reported_checkpoints()`` lists are those it keeps).
    """

    def __init__(self, storage, home, initial=None, on_report=None, score_attribute=None, on_resume=None,
                 checkpoint_config=None):
        self.storage, self.home, self.initial = storage, home, initial
        self.score_attribute, self.checkpoint_config = score_attribute, checkpoint_config
        self._on_report, self._on_resume = on_report, on_resume
        self.active = False
        self.resumed_preemption = False  # a function's preemption commit is durable already: nothing to write
        self._call = 0
        self._attempt = 0
        self._plan = None
        self._checkpointed = None  # (call, attempt) of the latest attempt that reported a checkpoint
        self._pending = None  # the poll of rank 0's reports in flight
        self.latest = None  # (uri, metrics) of the newest complete checkpoint known
        self.reported = []  # (uri, metrics) of every complete checkpoint, oldest first
        self.last_report = None  # rank 0's last record (its metrics as reported)
        self.reports = 0
        self._handled = None  # the index of the newest checkpoint on_report heard of (None: before the first plan)
        self._resume_directory = None  # the checkpoint the running attempt started from: never pruned under it

    # ----------------------------------------------------------------- the controller's protocol
    def prepare(self):
        """Nothing to start (the folder is the store)."""

    def begin_call(self, trains=True, replay=False):
        """A call of the function (the whole run): it commits at its reports, whatever ``trains`` and ``replay``."""
        self.active = True
        self._call += 1
        self._attempt = 0
        self._plan = self._make_plan()
        if self._plan.resume is not None:
            logger.info("Resuming the run from %s", self._plan.resume[0])
        self._resuming(restart=False)

    def check_store(self):
        """Nothing to check: the reports are read by :meth:`poll`."""

    def with_plan(self, kwargs, nodes=(), standby=()):
        """The attempt's keyword arguments with its :class:`~raysgd.train.reporting.ReportPlan` (``plan``)."""
        if self._plan is None:
            self._plan = self._make_plan()
        return {**kwargs, "plan": self._plan}

    def restart_state(self, kwargs):
        """After a failed attempt: the next attempt starts from the newest good checkpoint (in its plan; the
        function reads it with ``get_checkpoint()``); nothing for the workers to load, so None."""
        self._attempt += 1
        self._plan = self._make_plan()
        resume = self._plan.resume
        logger.info("The training function restarts from %s", resume[0] if resume else "its beginning (no checkpoint)")
        self._resuming(restart=True)
        return None

    def _resuming(self, restart):
        """An attempt's plan is made: ``on_resume`` hears the run folder's checkpoint it starts from, or None when a
        ``restart`` starts from the call's beginning."""
        if self._on_resume is None:
            return
        resume = cast(ReportPlan, self._plan).resume  # the attempt's plan is made
        if resume is not None and resume[1] is not None:
            self._on_resume(resume[1])
        elif restart:
            self._on_resume(None)

    def abandon_restart(self, kwargs):
        """Never needed: :meth:`restart_state` loads nothing."""

    def running_attempt(self):
        """``(call_id, attempt)`` of the running attempt (what a request to stop names), else None."""
        return (self._call, self._attempt) if self.active else None

    def committed_this_attempt(self):
        """``(call_id, attempt)`` once the running attempt reported a checkpoint (a report is then a commit point
        every rank reaches: a request to grow can be acted on), else None."""
        attempt = (self._call, self._attempt)
        return attempt if self.active and self._checkpointed == attempt else None

    def finish(self, results):
        """At the function's end: take rank 0's last reports from its answer; returns the per-rank results."""
        self._handle((results[0] or {}).get("reports") or [])
        self.active = False
        return results

    def close(self):
        """Nothing to close."""

    # ----------------------------------------------------------------- reports
    def poll(self, group):
        """Read rank 0's new reports without waiting (the controller's tick), handing each to ``on_report``."""
        try:
            records, self._pending = group.poll_first("take_reports", self._pending)
        except Exception as err:  # noqa: BLE001 (a lost poll: the next tick asks again)
            logger.debug("polling rank 0's reports failed: %s", err)
            records, self._pending = None, None
        if records:
            self._handle(records)

    def _handle(self, records):
        for record in records:
            if record.get("checkpoint") and (record.get("index") or 0) <= (self._handled or 0):
                continue  # heard already (rebuilt from its marker after a failure, then polled late)
            self.reports += 1
            self.last_report = record
            if record.get("checkpoint"):
                if record["attempt"] == self._attempt:
                    self._checkpointed = (self._call, record["attempt"])
                self.latest = (record["checkpoint"], record["metrics"][0])
                self.reported.append(self.latest)
                self._handled = max(self._handled or 0, record.get("index") or 0)
            if self._on_report is not None:  # first: what it writes beside the checkpoint must find it there
                self._on_report(record)
            if record.get("checkpoint"):
                self._prune()

    def _catch_up(self, candidates):
        """Hand ``on_report`` the checkpoints a failed attempt completed after the driver's last poll (its rank 0
        died with their records): rebuilt from their markers, so callbacks hear of every checkpoint once. The
        reports without a checkpoint of that span are lost (only rank 0 held them)."""
        missed = sorted((marker["index"], directory, marker) for directory, marker in candidates
                        if isinstance(marker.get("index"), int) and marker["index"] > (self._handled or 0))
        for index, directory, marker in missed:
            logger.debug("checkpoint %s completed after the last poll of the failed attempt", directory)
            self._handle([{"attempt": marker.get("attempt"), "report": marker.get("report"), "time": marker.get("time"),
                           "metrics": marker.get("rank_metrics") or [marker.get("metrics", {})],
                           "checkpoint": self.storage.uri(directory), "index": index, "seconds": None}])

    def _prune(self):
        try:
            self.storage.prune(protect={self._resume_directory} - {None})
        except Exception as err:  # noqa: BLE001 (a checkpoint left over is no failure)
            logger.warning("Pruning the checkpoints of %s failed: %s", self.storage.storage_path, err)

    # ----------------------------------------------------------------- where an attempt starts
    def _make_plan(self):
        candidates = self.storage.candidates(check=_is_report)  # newest first
        if self._handled is None:  # the run's first plan: what the folder holds was reported before this driver
            self._handled = max((m["index"] for _, m in candidates if isinstance(m.get("index"), int)), default=0)
        else:
            self._catch_up(candidates)
        found = self.newest_good(candidates)
        self._resume_directory = found[1] if found is not None else None
        resume = found if found is not None else \
            ((self.initial[0], None, None) if self.initial is not None else None)
        return ReportPlan(storage_root=self.storage.root, fs_path=self.storage.path, home=self.home,
                          call_id=self._call, attempt=self._attempt, first_index=self.storage.next_index(),
                          resume=resume, reported=list(self.reported), score_attribute=self.score_attribute,
                          checkpoint_config=self.checkpoint_config)

    def newest_good(self, candidates=None):
        """``(uri, directory, marker)`` of the newest complete checkpoint whose files match its marker, or None; a
        damaged newer one is skipped with a warning naming what is wrong. Also refreshes :attr:`reported`.
        ``candidates``: the folder's, newest first, when just read."""
        if candidates is None:
            candidates = self.storage.candidates(check=_is_report)
        self.reported = [(self.storage.uri(directory), marker.get("metrics", {}))
                         for directory, marker in reversed(candidates)]
        for directory, marker in candidates:
            try:
                rank_files.verify(self.storage.filesystem, directory, marker)
            except filesystem.DamagedCheckpoint as err:
                logger.warning("Skipping checkpoint %s (%s); falling back to the previous one", directory, err)
                continue
            uri = self.storage.uri(directory)
            self.latest = (uri, marker.get("metrics", {}))
            return uri, directory, marker
        return None


def complete_checkpoints(storage):
    """``[(uri, marker)]`` of the complete reported checkpoints of a run folder's ``storage``, oldest first (their
    markers only; the files are checked where a run starts from one).

    Example:
        >>> import tempfile
        >>> from raysgd.torch.storage.filesystem import CheckpointStorage, REPORT_MARKER
        >>> complete_checkpoints(CheckpointStorage(tempfile.mkdtemp(), None, marker=REPORT_MARKER))
        []
    """
    return [(storage.uri(directory), marker) for directory, marker in reversed(storage.candidates(check=_is_report))]


def _is_report(fs, directory, marker):
    """A candidate check: the marker is a reported checkpoint's (it lists its files)."""
    if marker.get("kind") != "report" or not isinstance(marker.get("files"), dict):
        raise filesystem.DamagedCheckpoint(f"checkpoint {directory!r} is not a checkpoint a training function "
                                           f"reported (its marker has no list of files)")
