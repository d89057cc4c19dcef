"""``report()`` as a commit point: every rank's checkpoint files merged into one checkpoint directory, marker last.

Part of :mod:`raysgd.train` (runs on the workers). The driver sends each attempt of a training function a
:class:`ReportPlan`: where the run's checkpoints go, the checkpoint the attempt starts from, and the attempt's number
(a request to stop names it). ``raysgd.train.report(metrics, checkpoint)`` is then a collective of every rank, as in
Ray Train (every rank calls it the same number of times):

1. The ranks exchange what they report (:func:`exchange`: one ``all_gather_object`` on a CPU group): their metrics,
   the names of their checkpoint's files, a directory name, and whether any of them must stop here (a SIGTERM, or the
   driver's request to grow or move: :mod:`raysgd.torch.commits.preemption`).
2. When any rank reported a checkpoint, rank 0 clears the directory of a failed attempt's leftovers, every rank then
   writes its own files into it from its own node (a file several ranks report is written once, by the lowest
   rank: DDP replicas hold the same bytes; :mod:`raysgd.torch.storage.rank_files`), and rank 0 writes the marker last:
   the files with their sizes and CRC-32, every rank's metrics, the data cursors of the loaders
   ``prepare_data_loader`` made, the world size. The checkpoint counts once its marker exists.
3. Every rank returns once the checkpoint is durable. A rank that must stop then ends the attempt at this point: a
   SIGTERM at the next report (the checkpoint, if any, is durable; the signalled process then exits), a resize at
   the next report with a checkpoint (nothing is trained twice).

An error while writing (a full disk, a storage outage) is exchanged too, so every rank raises the same
:class:`~raysgd.torch.errors.CheckpointError` and none waits for the others: the run's failure policy retries it.

Example:
    >>> plan = ReportPlan(storage_root="/tmp/runs/exp", fs_path="/tmp/runs/exp", home=None, call_id=1, attempt=0,
    ...                   first_index=3)
    >>> plan.directory_name(None, reported=1)
    'checkpoint_000004'
"""
import dataclasses
import logging
import pickle
import threading
import time

import torch.distributed as dist

from raysgd.base.checks import plain_json
from raysgd.torch.errors import CheckpointError
from raysgd.torch.commits import preemption
from raysgd.torch.storage import filesystem, rank_files
from raysgd.train import retention

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ReportPlan:
    """One attempt's reporting, made by the driver (:class:`raysgd.train.commits.ReportCommits`).

    Attributes:
        storage_root: the run's folder ``storage_path/name`` as a path or URI any node resolves.
        fs_path: that folder's path inside its filesystem.
        home: the node id of the driver's machine, whose disk a local folder is on (None: a URI).
        call_id, attempt: what the driver's requests to stop name.
        first_index: the index of the attempt's first checkpoint (one past every directory in the folder).
        resume: ``(uri, directory, marker)`` of the checkpoint the attempt starts from, or None.
        reported: ``[(uri, metrics)]`` of the complete checkpoints before this attempt, oldest first.
        score_attribute: ``CheckpointConfig(checkpoint_score_attribute)``, checked before a checkpoint is written.
        checkpoint_config: the run's ``CheckpointConfig`` (None: keep all): which of :attr:`Reporter.reported` the
            driver has deleted, or will (``get_all_reported_checkpoints()`` leaves them out).
    """

    storage_root: str
    fs_path: str
    home: str
    call_id: int
    attempt: int
    first_index: int
    resume: tuple | None = None
    reported: list = dataclasses.field(default_factory=list)
    score_attribute: str | None = None
    checkpoint_config: object = None

    def directory_name(self, name, reported):
        """The directory of the attempt's checkpoint after ``reported`` earlier ones: ``name`` when given, else
        ``checkpoint_NNNNNN``."""
        return name or filesystem.numbered(self.first_index + reported)

    def directory(self, name):
        """The path of the checkpoint directory ``name`` inside the filesystem."""
        return f"{self.fs_path}/{name}"

    def uri(self, name):
        """The path or URI a user names the checkpoint directory ``name`` by."""
        return filesystem.child_uri(self.storage_root, name)


class Reporter:
    """One rank's side of the protocol (see the module docstring), for one attempt of the training function.

    Args:
        plan: the attempt's :class:`ReportPlan`.
        rank, world_size: this rank's place; ``backend``: the process group's (a CPU group is made for NCCL).
        cursors: a function returning the data cursors of the prepared loaders (rank 0's go into the marker).
    """

    def __init__(self, plan, rank, world_size, backend="gloo", cursors=lambda: []):
        self.plan, self.rank, self.world_size, self.backend = plan, rank, world_size, backend
        self._cursors = cursors
        self.count = 0  # reports so far in this attempt
        self.checkpoints = 0  # of them with a checkpoint
        self.latest = None  # (uri, metrics) of this attempt's latest checkpoint
        self.last_metrics = None  # this rank's latest reported metrics (the progress bar shows their losses)
        self.records = []  # rank 0: what the driver has not taken yet (take(), from another thread)
        self._records_lock = threading.Lock()
        self.reported = list(plan.reported)  # (uri, metrics) of every complete checkpoint, oldest first
        self._group = None

    # ----------------------------------------------------------------- collectives
    def _cpu_group(self):
        if self.backend == "gloo":
            return None
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def exchange(self, mine):
        """Every rank's ``mine``, in rank order (one ``all_gather_object``; alone, ``[a copy of mine]``)."""
        if self.world_size == 1:
            return [_copy(mine)]
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, mine, group=self._cpu_group())
        return gathered

    # ----------------------------------------------------------------- report
    def report(self, metrics, source=None, name=None):
        """Report ``metrics`` with the files of the local folder ``source`` (None: no checkpoint) under the
        directory ``name`` (None: numbered); returns the checkpoint's uri when any rank reported one, else None.
        Ends the attempt (:func:`~raysgd.torch.commits.preemption.leave`) when the ranks must stop here."""
        started = time.monotonic()
        files = rank_files.local_files(source, skip=filesystem.REPORT_FILES) if source is not None else None
        level = preemption.PREEMPT if preemption.requested() else \
            preemption.RESIZE if preemption.resize_wanted(self.plan.call_id, self.plan.attempt) else preemption.GO_ON
        infos = self.exchange({"metrics": metrics, "files": files, "name": name, "level": level})
        self.count += 1
        self.last_metrics = metrics
        level = max(info["level"] for info in infos)
        uri = None
        if any(info["files"] is not None for info in infos):
            uri = self._commit(infos, source, files)
        if self.rank == 0:
            with self._records_lock:
                self.records.append({"attempt": self.plan.attempt, "report": self.count, "time": time.time(),
                                     "metrics": [info["metrics"] for info in infos], "checkpoint": uri,
                                     "index": self.plan.first_index + self.checkpoints - 1 if uri else None,
                                     "seconds": time.monotonic() - started})
        if level == preemption.PREEMPT or (level == preemption.RESIZE and uri is not None):
            preemption.stopping(level)
            logger.info("Rank %d stops at report %d (%s)", self.rank, self.count, uri or "no checkpoint")
            preemption.leave(_Rank(self.rank), self.count, level)
        return uri

    def _commit(self, infos, source, files):
        """Write this report's checkpoint (every rank takes part); returns its uri."""
        if self.plan.score_attribute:  # every rank checks rank 0's metrics: all refuse it alike, nothing written
            retention.check_score(infos[0]["metrics"], self.plan.score_attribute)
        name = next((info["name"] for info in infos if info["files"] is not None and info["name"]), None)
        name = self.plan.directory_name(name, self.checkpoints)
        directory = self.plan.directory(name)
        problem = None
        if self.rank == 0:
            try:
                rank_files.prepare_directory(self.plan.storage_root, directory, filesystem.REPORT_MARKER,
                                             home=self.plan.home)
            except Exception as err:  # noqa: BLE001 (exchanged: every rank raises it)
                problem = f"{type(err).__name__}: {err}"
        problem = self.exchange(problem)[0]
        if problem is not None:
            raise CheckpointError(f"report(checkpoint=...): {problem}")
        claimed: dict[str, int] = {}  # file -> the lowest rank reporting it
        for rank, info in enumerate(infos):
            for file in info["files"] or ():
                claimed.setdefault(file, rank)
        mine = [file for file in files or () if claimed[file] == self.rank]
        try:
            answer = rank_files.write_files(self.plan.storage_root, directory, source, mine, home=self.plan.home) \
                if mine else ({}, None)
        except Exception as err:  # noqa: BLE001 (exchanged: every rank raises it)
            answer = f"rank {self.rank}: {type(err).__name__}: {err}"
        written = self.exchange(answer)
        failed = [answer for answer in written if isinstance(answer, str)]
        marker = None
        if not failed and self.rank == 0:
            try:
                merged = {file: size_crc for part, _ in written for file, size_crc in part.items()}
                meta = {"kind": "report", "index": self.plan.first_index + self.checkpoints, "name": name,
                        "written_on": {rank: node for rank, (part, node) in enumerate(written) if part},
                        "metrics": plain_json(infos[0]["metrics"]),
                        "rank_metrics": [plain_json(info["metrics"]) for info in infos],
                        "cursors": self._cursors(), "world_size": self.world_size, "attempt": self.plan.attempt,
                        "report": self.count}
                marker = rank_files.write_marker(self.plan.storage_root, directory, merged, meta,
                                                 filesystem.REPORT_MARKER, home=self.plan.home)
            except Exception as err:  # noqa: BLE001 (exchanged: every rank raises it)
                failed = [f"rank 0 (the marker): {type(err).__name__}: {err}"]
        failed = self.exchange(failed)[0]  # rank 0's: the others' and the marker's
        if failed:
            raise CheckpointError(f"report(checkpoint=...): the checkpoint {name!r} could not be written: "
                                  f"{'; '.join(failed)}")
        uri = self.plan.uri(name)
        self.checkpoints += 1
        self.latest = (uri, infos[0]["metrics"])
        self.reported.append(self.latest)
        if marker is not None:
            logger.debug("checkpoint %s written (%d files)", uri, len(marker["files"]))
        return uri

    def take(self):
        """Rank 0's records not taken yet, and forget them (the driver polls them while the function runs)."""
        with self._records_lock:
            taken, self.records = self.records, []
        return taken


def _copy(value):
    """``value`` as a gather gives it: a copy made by pickle (a training function that updates its metrics dict after
    ``report()`` changes no report already made), or ``value`` itself when it cannot be pickled.

    Example:
        >>> metrics = {"loss": 0.5}
        >>> copied = _copy(metrics)
        >>> metrics["loss"] = 0.1
        >>> copied
        {'loss': 0.5}
    """
    try:
        return pickle.loads(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception as err:  # noqa: BLE001 (unpicklable metrics stay as they were given)
        logger.debug("report(): the metrics cannot be pickled (%s); they are kept as given, not copied", err)
        return value


class _Rank:
    """What :func:`~raysgd.torch.commits.preemption.leave` reads of a worker: its rank."""

    def __init__(self, rank):
        self.world_rank = rank
