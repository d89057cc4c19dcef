"""Durable runs: the trainer's automatic checkpoints in ``storage_path`` and the resume from them.

Helper of layer 7 (:mod:`raysgd.torch.torch_trainer`). ``TorchTrainer(storage_path=..., num_to_keep=2,
resume=True)`` opens a :class:`DurableRun`; it checks the arguments before any actor starts, starts
reading the markers of the complete checkpoints while the workers start (:meth:`DurableRun.restore`), has the
newest one's state file read and loaded on the workers' side (:meth:`DurableRun.resume`, falling back to an older
one when it is damaged), and writes the state the trainer hands it at the end of every ``train()``, at ``save()``
and, after a worker's preemption, the commit it took (:meth:`DurableRun.on_recovery`), on a background thread
(:class:`~raysgd.torch.storage.async_writer.AsyncWriter`: one upload in flight, the newest waiting one wins).
With each state it writes the states its caller hands it (``states``: the driver-side components', such as the
callbacks' and the result log's, :mod:`raysgd.base.stateful`, or a function returning them that is called only when a
checkpoint is written) into the marker, and :meth:`DurableRun.resume` returns
that marker: the caller restores its components from it. Storage writes what it is given; the one call it makes
out is to that states function.
After a ``train()`` that state is a part written by a task on the node holding it
(:class:`~raysgd.torch.storage.parts.RemotePart`); this thread writes only the marker. The storage format is
:mod:`raysgd.torch.storage.filesystem`'s.

Example:
    >>> import tempfile
    >>> from raysgd.torch.state.checkpoint import state_to_bytes
    >>> path = tempfile.mkdtemp()
    >>> run = open_run(path, num_to_keep=2, resume=True)
    >>> run.submit(state_to_bytes({"epoch": 1, "models": [], "optimizers": [], "operator": None}), epoch=1)
    >>> run.close()
    >>> again = open_run(path, num_to_keep=2, resume=True)
    >>> again.restore().marker["epoch"]
    1
    >>> again.close()
"""
from __future__ import annotations

import logging
import threading
import time

from raysgd.base import environment
from raysgd.base.checks import expect
from raysgd.torch.fault_tolerance import stops
from raysgd.torch.storage import async_writer, filesystem
from typing import Any, Callable, Mapping

logger = logging.getLogger(__name__)

States = Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None
"""The driver-side components' states for a checkpoint's marker: the mapping, or a function returning it, called only
when a checkpoint is written (a run without storage never asks its components, and one such as an MLflow logger may
wait to answer)."""


class NoStorage:
    """What ``open_run`` returns without a ``storage_path``: every method does nothing, so callers need no ``if``."""

    def resume(self, load_checkpoint: Callable[[str, dict], Any], timeout_s: float | None = None) -> None:
        return None

    def submit(self, stream: bytes | Callable[[], bytes], **meta: Any) -> None:
        pass

    def on_result(self, phase: str, result: Any, stream: bytes | Callable[[], bytes],
                  states: States = None) -> None:
        pass

    def on_save(self, state: Any, stream: bytes | Callable[[], bytes], states: States = None) -> Any:
        return state

    def on_recovery(self, failure: Any, part: Any, epoch: int | None = None, preempted: bool = False,
                    states: States = None) -> None:
        pass

    def flush(self, timeout_s: float | None = None) -> None:
        pass

    def close(self, timeout_s: float | None = None) -> None:
        pass


def open_run(storage_path: str | None, num_to_keep: int = 2, resume: bool = True,
             on_written: Callable[[str, float], Any] | None = None) -> DurableRun | NoStorage:
    """``TorchTrainer(storage_path=...)``: a checked :class:`DurableRun`, or :class:`NoStorage` without a path.

    ``on_written(path, seconds)`` runs (on the writer thread) after each checkpoint is complete, with the seconds its
    write took.

    Example:
        >>> open_run(None).resume(None) is None
        True
        >>> open_run("/tmp/x", num_to_keep=0)
        Traceback (most recent call last):
        ValueError: TorchTrainer: num_to_keep expects an int >= 1 (checkpoints kept in storage_path); got 0
    """
    expect(resume in (True, False), "resume", "True or False", resume, TypeError, "TorchTrainer")
    if storage_path is None:
        return NoStorage()
    checkpoints = filesystem.CheckpointStorage(storage_path, num_to_keep)  # without pyarrow: says what to install
    checkpoints.check_writable()  # a real write and delete, before any actor starts
    run = DurableRun(checkpoints, resume=resume, on_written=on_written)
    run.start_restore()  # reads the newest checkpoint while Ray and the workers start
    return run


class DurableRun:
    """Automatic checkpoints of one trainer (see the module docstring)."""

    _reader: threading.Thread | None  # (set in __init__: typed here)

    def __init__(self, checkpoint_storage: filesystem.CheckpointStorage, resume: bool = True,
                 on_written: Callable[[str, float], Any] | None = None) -> None:
        self.storage = checkpoint_storage
        self.resume_enabled = resume
        self._on_written = on_written
        self._writer = async_writer.AsyncWriter()
        self._reader = None
        self._restored = None
        self._read_error: BaseException | None = None

    def start_restore(self) -> None:
        """Begin reading the newest complete checkpoint on a thread (nothing when ``resume=False``)."""
        if not self.resume_enabled or self._reader is not None:
            return
        self._reader = threading.Thread(target=self._read, name="raysgd-checkpoint-reader", daemon=True)
        self._reader.start()

    def _read(self):
        try:
            self._restored = self.storage.candidates()  # markers only: the state files are read where they load
        except BaseException as err:  # noqa: BLE001 (raised by restore() in the caller's thread)
            self._read_error = err

    def _candidates(self, timeout_s):
        if self._reader is None:
            return []
        self._reader.join(timeout_s)
        if self._reader.is_alive():
            raise TimeoutError(f"reading the newest checkpoint of {self.storage.storage_path!r} took more than "
                               f"{timeout_s} s")
        if self._read_error is not None:
            raise self._read_error
        return self._restored

    def restore(self, timeout_s: float | None = None) -> filesystem.Restored | None:
        """The newest complete checkpoint (by its marker) as a :class:`~raysgd.torch.storage.filesystem.Restored`
        without its state bytes (``stream`` is None: :meth:`resume` has them read where they load), or None."""
        found = self._candidates(timeout_s)
        return filesystem.Restored(None, found[0][1], found[0][0]) if found else None

    def resume(self, load_checkpoint: Callable[[str, dict], Any],
               timeout_s: float | None = None) -> filesystem.Restored | None:
        """Load the newest complete checkpoint with ``load_checkpoint(directory, marker)``, which reads and checks its
        state file on the workers' side and raises :class:`~raysgd.torch.storage.filesystem.DamagedCheckpoint` when it
        does not match its marker: the previous one is then tried (logged). Returns the
        :class:`~raysgd.torch.storage.filesystem.Restored` checkpoint (its ``stream`` None; its ``marker`` holds the
        ``states`` written with it, for the caller to restore its components from), or None (nothing to resume
        from)."""
        for directory, marker in self._candidates(timeout_s):
            try:
                load_checkpoint(directory, marker)
            except filesystem.DamagedCheckpoint as err:
                logger.warning("Skipping checkpoint %s (%s); falling back to the previous one", directory, err)
                continue
            logger.info("Resuming from %s (epoch %s, written at the end of %s)", directory, marker.get("epoch"),
                        marker.get("reason", "?"))
            return filesystem.Restored(None, marker, directory)
        if self._reader is not None:
            logger.info("No checkpoint in %s: starting a new run", self.storage.storage_path)
        return None

    def submit(self, stream: bytes | Callable[[], bytes], raise_error: bool = True,
               states: States = None, **meta: Any) -> None:
        """Write ``stream`` (trainer state bytes, or a function returning them) with ``meta`` in its marker.

        Asynchronous: see :class:`~raysgd.torch.storage.async_writer.AsyncWriter`; an earlier write's failure is raised
        here (``raise_error=False``: later). ``states`` (:data:`States`; a function is called here, so the states match
        the results logged so far) go into the marker too, each under its name, for :meth:`resume`.
        """
        stream = stream() if callable(stream) else stream
        states = states() if callable(states) else states
        clash = sorted(set(states or {}) & set(meta))
        expect(not clash, "states", "names apart from the marker's own keys", clash, caller="DurableRun.submit",
               call=True)
        meta.update(states or {})
        self._writer.submit(self._write, stream, meta, raise_error=raise_error,
                            description=f"checkpoint of epoch {meta.get('epoch')} to {self.storage.storage_path}")

    def _write(self, stream, meta):
        started = time.monotonic()
        path = self.storage.write(stream, meta)
        seconds = time.monotonic() - started  # the upload: the state, its marker, the pruning
        if self._on_written is not None:
            try:
                self._on_written(path, seconds)
            except Exception:  # noqa: BLE001 (the checkpoint is durable: a listener's error must not fail it)
                logger.warning("on_written(%s) raised", path, exc_info=True)
        return path

    def on_result(self, phase: str, result: Any, stream: bytes | Callable[[], bytes],
                  states: States = None) -> None:
        """After a ``train()`` result was logged: checkpoint the state (``stream``: bytes or a function returning them)
        with ``states`` in its marker (see :meth:`submit`)."""
        if phase == "train":
            self.submit(stream, states=states, reason="train", epoch=result.get("epoch"))

    def on_save(self, state: Any, stream: bytes | Callable[[], bytes], states: States = None) -> Any:
        """At ``save()``: checkpoint ``state`` (whose bytes ``stream`` gives) to storage too; returns ``state``."""
        self.submit(stream, states=states, reason="save", epoch=state["epoch"])
        return state

    def on_recovery(self, failure: Any, part: Any, epoch: int | None = None, preempted: bool = False,
                    states: States = None) -> None:
        """Recovering from ``failure``: checkpoint the commit resumed from (of ``epoch``; ``part``: a function
        returning its state bytes or a part written elsewhere) when it is a preemption commit: ``preempted`` (the
        ranks marked it so in the commit store before any exited) or a rank's error says so. A process's exit may
        reach the driver before the marked errors; the store's mark does not race."""
        if part is not None and (preempted or stops.was_preempted(failure)):
            failed = self._writer.failed  # raising it here would abort the recovery and leave the group broken
            if failed is not None:
                logger.warning("An earlier checkpoint write failed (%s): recovering anyway; the error is raised at "
                               "the end of this call (or by save() or shutdown())", failed)
            self.submit(part, raise_error=False, states=states, reason="preemption", epoch=epoch)

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every submitted checkpoint is durable (raises a failed write's error)."""
        self._writer.flush(timeout_s)

    def close(self, timeout_s: float | None = None) -> None:
        """Flush (waiting at most ``timeout_s``, default ``SGD_CHECKPOINT_FLUSH_S``), then stop the writer thread.
        A write still running then raises ``TimeoutError`` naming it; a failed one its ``CheckpointError``."""
        self._writer.close(environment.get("SGD_CHECKPOINT_FLUSH_S")
                           if timeout_s is None else timeout_s)
