"""Weights & Biases as a callback: the trainer's config as the run config, every result at ``step=epoch``.

Layer 6 (the edge): wandb is optional (``pip install "raysgd[wandb]"``), imported when a logger is made.
:class:`WandbLogger` logs through a run object of its own (``wandb.init(..., reinit="create_new")``, never
``wandb.run`` or ``wandb.log``), so several trainers in one process log to their own runs:

- The run starts at the first result (``project``, ``name``, ``mode``, ``dir``, ``tags``, ``group``: as
  ``wandb.init``'s), with the trainer's ``config`` as its config (values that are not JSON become text).
- Every ``train()`` result's numbers are logged as ``train/<name>`` at ``step=result["epoch"]``; every
  ``validate()`` result's as ``validate/<name>`` at the epoch of the last ``train()`` (0 before any): one
  history row per epoch. A nested dict's numbers (``profile=True``'s ``profile``) as ``train/profile/<name>``.
- With ``log_checkpoints=True`` each durable checkpoint (``storage_path``) in a local folder is logged as an
  artifact of type ``checkpoint``.
- The run is finished at ``trainer.shutdown()``.
- With a durable run (``storage_path``) the run id is kept in every checkpoint's marker; a driver that crashed
  and runs again continues the **same** run (``wandb.init(id=..., resume="allow")``). A step logged before the
  crash but after the checkpoint it resumes from is not logged again: wandb refuses a step below its current one,
  so the logger skips those itself (online: the run's step from the server; offline: the history of the run's
  earlier offline segments in ``dir``, read with :func:`read_offline_history`). Every step appears once. A
  training function (``raysgd.train``) restarted after a failure rewinds its callbacks to the checkpoint it runs
  again from, with the run still open: the steps this process logged since are skipped the same way.
  Offline, wandb's core process buffers the segment's log: what it had not written when the driver was killed is
  lost (online, what reached the server stays).

Example:
    >>> from raysgd.loggers import WandbLogger  # doctest: +SKIP
    >>> logger = WandbLogger(project="digits", mode="offline", dir="/tmp/wandb")  # doctest: +SKIP
    >>> trainer = TorchTrainer(training_operator_cls=MyOperator, callbacks=[logger])  # doctest: +SKIP
    >>> check_arguments("digits", None, "online-ish", None, None, None, False)
    Traceback (most recent call last):
    ...
    TypeError: WandbLogger: mode expects None, 'online', 'offline' or 'disabled'; got 'online-ish'
"""
from __future__ import annotations

import glob
import json
import logging
import os
import struct

from raysgd import optional
from raysgd.base.checks import expect, is_number
from raysgd.torch.integrations.tracker import EpochLogger, numbers
from typing import Any

logger = logging.getLogger(__name__)

MODES = (None, "online", "offline", "disabled")

_BLOCK = 32768  # wandb's transaction log: LevelDB's log format, 32 KiB blocks of records with 7-byte headers
_FULL, _LAST = 1, 4


def check_arguments(project, name, mode, dir, tags, group, log_checkpoints):  # noqa: A002 (wandb.init's name)
    """:class:`WandbLogger`'s checks: every error names the argument, what it expects and the value given."""
    how = {"error": TypeError, "caller": "WandbLogger"}
    expect(isinstance(project, str) and project, "project", "a non-empty str", project, **how)
    expect(name is None or isinstance(name, str), "name", "None or a str", name, **how)
    expect(mode in MODES, "mode", "None, 'online', 'offline' or 'disabled'", mode, **how)
    expect(dir is None or (isinstance(dir, (str, os.PathLike)) and os.fspath(dir)), "dir",
           "None or a local folder", dir, **how)
    expect(tags is None or (isinstance(tags, (list, tuple)) and all(isinstance(t, str) for t in tags)), "tags",
           "None or a list of str", tags, **how)
    expect(group is None or isinstance(group, str), "group", "None or a str", group, **how)
    expect(isinstance(log_checkpoints, bool), "log_checkpoints", "True or False", log_checkpoints, **how)


def jsonable(value):
    """``value`` with what JSON cannot hold as text (a run config must be JSON).

    Example:
        >>> jsonable({"lr": 0.1, "opt": {"cls": object}, "sizes": (1, 2)})
        {'lr': 0.1, 'opt': {'cls': "<class 'object'>"}, 'sizes': [1, 2]}
    """
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def read_records(path, record_cls):
    """Every record of a wandb transaction log (``run-<id>.wandb``), parsed with ``record_cls``.

    The file is LevelDB's log format behind a 7-byte ``:W&B`` header: 32 KiB blocks of chunks, each with a
    7-byte header (crc32, length, type: full, first, middle, last). A torn tail (a killed writer) ends the read.

    Example:
        >>> from wandb.proto.wandb_internal_pb2 import Record  # doctest: +SKIP
        >>> [r.WhichOneof("record_type") for r in read_records("run-abc.wandb", Record)][:2]  # doctest: +SKIP
        ['header', 'run']
    """
    with open(path, "rb") as handle:
        data = handle.read()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a wandb transaction log (header {data[:7]!r})")
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 or pos + 7 + length > len(data):
            break  # zeros (preallocated) or a torn record
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (_FULL, _LAST):
            record = record_cls()
            record.ParseFromString(pending)
            pending = b""
            yield record


def read_offline_history(path):
    """The history rows of a wandb transaction log as dicts (``_step`` and the logged keys, JSON-decoded).

    Example:
        >>> rows = read_offline_history("wandb/offline-run-20260101_000000-abc/run-abc.wandb")  # doctest: +SKIP
        >>> [(row["_step"], row["train/train_loss"]) for row in rows]  # doctest: +SKIP
        [(1, 0.52), (2, 0.31)]
    """
    record_cls = optional.require("wandb.proto.wandb_internal_pb2", "read_offline_history").Record
    rows = []
    for record in read_records(path, record_cls):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


class WandbLogger(EpochLogger):
    """Logs a trainer's run to Weights & Biases (see the module docstring).

    Args:
        project, name, mode, dir, tags, group: ``wandb.init``'s (``mode="offline"`` writes under ``dir`` only;
            ``wandb sync`` uploads it later).
        log_checkpoints: log each local durable checkpoint as a ``checkpoint`` artifact.

    Example:
        >>> WandbLogger(tags="a")  # doctest: +SKIP
        Traceback (most recent call last):
        TypeError: WandbLogger: tags expects None or a list of str; got 'a'
    """

    def __init__(self, project: str = "raysgd", name: str | None = None, mode: str | None = None,
                 dir: str | None = None, tags: list[str] | None = None, group: str | None = None,  # noqa: A002
                 log_checkpoints: bool = False) -> None:
        check_arguments(project, name, mode, dir, tags, group, log_checkpoints)
        self._wandb = optional.require("wandb", "raysgd.loggers.WandbLogger")  # before any actor starts
        self.project, self.name, self.mode, self.group = project, name, mode, group
        self.dir = os.path.abspath(os.fspath(dir)) if dir is not None else None
        self.tags, self.log_checkpoints = list(tags or []), log_checkpoints
        self.run_id = None
        self._wandb_run: Any = None  # wandb's Run once started (wandb is optional: no types of its own here)
        self._resumed = False  # load_state_dict named a run to continue
        self._first_new_step = 0  # resumed: the steps below it are in the run already (logged before the crash)
        self._last_step = 0  # the last step logged by this process (wandb refuses lower ones)

    def __getstate__(self):
        """Picklable (a Tune trial ships its trainer's options): the module is imported again there, the run is
        not shipped (a copy starts or continues its own)."""
        return {**self.__dict__, "_wandb": None, "_wandb_run": None}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._wandb = optional.require("wandb", "raysgd.loggers.WandbLogger")

    @property
    def run(self) -> Any:
        """The ``wandb`` Run this logger logs to (None before the first result and after shutdown)."""
        return self._wandb_run

    # ----------------------------------------------------------------- the run
    def _ensure_run(self, trainer):
        if self._wandb_run is not None:
            return self._wandb_run
        if self.dir is not None:
            os.makedirs(self.dir, exist_ok=True)
        options = dict(project=self.project, name=self.name, mode=self.mode, dir=self.dir, tags=self.tags or None,
                       group=self.group, config=jsonable(dict(getattr(trainer, "config", None) or {})),
                       reinit="create_new")
        if self.run_id is not None:
            options.update(id=self.run_id, resume="allow")
        self._wandb_run = self._wandb.init(**options)
        self.run_id = self._wandb_run.id
        if self._resumed:
            self._first_new_step = max(self._first_new_step, self._run_step(), self._offline_step() + 1)
            logger.info("Continuing wandb run %s after step %d (steps below %d are in it already)", self.run_id,
                        self.epoch, self._first_new_step)
        else:
            logger.info("wandb run %s in project %r (%s)", self.run_id, self.project, self.mode or "wandb's mode")
        return self._wandb_run

    def _run_step(self):
        """The run's first step as wandb knows it (online and resumed: the server's last step + 1; offline: 0)."""
        try:
            step = self._wandb_run.starting_step
        except Exception:  # noqa: BLE001 (a wandb without it, or a mode that does not know it)
            return 0
        return int(step) if is_number(step) else 0

    def _offline_step(self):
        """Offline: the last step in the history of this run's earlier offline segments in its folder (-1: none)."""
        run_dir = getattr(self._wandb_run, "dir", None)
        if not run_dir or getattr(self._wandb_run.settings, "mode", None) != "offline":
            return -1
        segment = os.path.dirname(os.path.abspath(run_dir))  # <dir>/wandb/offline-run-<time>-<id>/files
        last = -1
        pattern = os.path.join(os.path.dirname(segment), f"offline-run-*-{self.run_id}", f"run-{self.run_id}.wandb")
        for path in sorted(glob.glob(pattern)):
            if os.path.dirname(path) == segment:
                continue
            try:
                steps = [row.get("_step", -1) for row in read_offline_history(path)]
            except Exception:  # noqa: BLE001 (a log we cannot read: its steps are not known, log as usual)
                logger.warning("Cannot read wandb's offline log %s; its steps may be logged again", path,
                               exc_info=True)
                continue
            last = max([last] + [s for s in steps if is_number(s)])
        return int(last)

    def log_result(self, trainer, phase, result, step):
        """Log a result's numbers as ``<phase>/<name>`` at ``step`` (never a step below wandb's current one)."""
        run = self._ensure_run(trainer)
        metrics = numbers(result, f"{phase}/")
        if step < self._first_new_step:
            logger.info("wandb run %s already holds step %d (logged before the driver stopped): its %d %s "
                        "metrics are kept as they are", self.run_id, step, len(metrics), phase)
            return
        if step < self._last_step:  # an older state loaded: wandb refuses a step below its current one
            logger.warning("wandb run %s is at step %d: the %s result of step %d is not logged (wandb takes no "
                           "step below its current one)", self.run_id, self._last_step, phase, step)
            return
        if metrics:
            run.log(metrics, step=step)
            self._last_step = step

    # ----------------------------------------------------------------- hooks
    def started(self):
        return self._wandb_run is not None

    def log_checkpoint(self, folder, path):
        artifact = self._wandb.Artifact(f"{self.run_id}-checkpoints", type="checkpoint",
                                        metadata={"epoch": self.epoch, "path": path})
        artifact.add_dir(folder)
        self._wandb_run.log_artifact(artifact, aliases=[os.path.basename(folder), "latest"])

    def on_shutdown(self, trainer: Any) -> None:
        if self._wandb_run is not None:
            run, self._wandb_run = self._wandb_run, None
            run.finish()

    # ----------------------------------------------------------------- a durable run's state
    def state_dict(self) -> dict | None:
        """``{"run_id", "step"}``: kept in every durable checkpoint's marker."""
        if self.run_id is None:
            return None
        return {"run_id": self.run_id, "step": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        """Continue the run a durable checkpoint names, from its step (the run is resumed at the next result). With
        the run open in this process (a training function restarted after a failure, rewinding its callbacks to
        the checkpoint it resumes from), the steps this process logged since are in it already."""
        self.run_id = state.get("run_id")
        self.epoch = int(state.get("step") or 0)
        self._resumed = self.run_id is not None
        self._first_new_step = self.epoch + 1 if self._resumed else 0
        if self._wandb_run is not None and self._wandb_run.id == self.run_id:
            self._first_new_step = max(self._first_new_step, self._last_step + 1)
