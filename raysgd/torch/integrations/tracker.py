"""What every experiment-tracker logger shares: a step per epoch, numbers only, local checkpoints as artifacts.

Layer 6 (the edge; the standard library and :mod:`raysgd.callbacks`). :class:`EpochLogger` is the base of
:class:`~raysgd.torch.integrations.mlflow_logger.MLflowLogger` and
:class:`~raysgd.torch.integrations.wandb_logger.WandbLogger`: a ``train()`` result is logged at
``step=result["epoch"]`` (the previous step + 1 when it has none), a ``validate()`` result at the epoch of the last
``train()`` (0 before any), and a durable checkpoint in a local folder goes to the tracker when the logger was
made with ``log_checkpoints=True``. A subclass logs (``log_result``) and stores checkpoints (``log_checkpoint``)
in its own tracker, says whether its run has started (``started``), and keeps its run and step
(``state_dict``/``load_state_dict``); :meth:`EpochLogger.rewind` goes back to step 0 of the same run.
:class:`BackgroundWriter` takes a logger's writes off the training call's path (one thread, in order, a bounded
queue, deadlines, errors kept).

Example:
    >>> class Steps(EpochLogger):
    ...     log_checkpoints, seen = False, []
    ...     def log_result(self, trainer, phase, result, step):
    ...         self.seen.append((phase, step, numbers(result)))
    >>> steps = Steps()
    >>> steps.on_train_result(None, {"epoch": 3, "train_loss": 0.5, "note": "x"})
    >>> steps.on_validate_result(None, {"val_loss": 0.7})
    >>> steps.seen
    [('train', 3, {'epoch': 3, 'train_loss': 0.5}), ('validate', 3, {'val_loss': 0.7})]
"""
import logging
import os
import queue
import threading
from typing import Any, Callable

from raysgd.base.checks import is_number
from raysgd.base.paths import is_uri
from raysgd.callbacks import Callback

logger = logging.getLogger(__name__)


def flatten(values, prefix=""):
    """``{"a": {"b": 1}}`` -> ``{"a/b": 1}``: a nested dict's entries under ``<key>/<its key>``, each key as text.
    The one home of a result's names in the loggers (the result log's columns, MLflow's and W&B's metrics).

    Example:
        >>> flatten({"lr": 0.1, "opt": {"momentum": 0.9}}, "train/")
        {'train/lr': 0.1, 'train/opt/momentum': 0.9}
    """
    flat = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}/"))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def numbers(result, prefix=""):
    """The entries of ``result`` that are metrics (real numbers, :func:`~raysgd.base.checks.is_number`), nested
    dicts flattened (:func:`flatten`), each name after ``prefix``.

    Example:
        >>> numbers({"train_loss": 0.5, "note": "x", "flag": True, "profile": {"mean_fwd_s": 0.01}}, "train/")
        {'train/train_loss': 0.5, 'train/profile/mean_fwd_s': 0.01}
    """
    return {key: value for key, value in flatten(result, prefix).items() if is_number(value)}


def local_folder(path):
    """The local folder a durable checkpoint ``path`` names (a plain path or ``file://``), else None.

    Example:
        >>> local_folder("s3://bucket/run/checkpoint_000001") is None
        True
    """
    local = path[len("file://"):] if path.startswith("file://") else path
    return local if not is_uri(local) and os.path.isdir(local) else None


class EpochLogger(Callback):
    """Base of the tracker loggers (see the module docstring); ``self.log_checkpoints`` is set by the subclass."""

    #: The step of the latest ``train()`` result: ``validate()`` results are logged at it.
    epoch = 0
    log_checkpoints: bool  # set by the subclass (see the class docstring)

    def log_result(self, trainer, phase, result, step):
        """Log ``result`` (a ``"train"`` or ``"validate"`` result) at ``step`` in the tracker."""
        raise NotImplementedError

    def log_checkpoint(self, folder, path):
        """Store the durable checkpoint in the local ``folder`` (``path`` as the trainer named it)."""
        raise NotImplementedError

    def started(self):
        """Whether the tracker's run has started (checkpoints are logged only then)."""
        return True

    def rewind(self):
        """The run starts again from its beginning: the next ``train()`` result without an ``epoch`` is step 1 again,
        in the same tracker run, where the steps it holds are kept (the logger's resume rules: see
        ``load_state_dict``). Before its run started there is nothing to keep."""
        state = self.state_dict()
        if state is None:
            self.epoch = 0
            return
        self.load_state_dict({**state, "step": 0})

    def on_train_result(self, trainer, result):
        epoch = result.get("epoch")
        self.epoch = int(epoch) if is_number(epoch) else self.epoch + 1
        self.log_result(trainer, "train", result, self.epoch)

    def on_validate_result(self, trainer, result):
        self.log_result(trainer, "validate", result, self.epoch)

    def on_checkpoint(self, trainer, path):
        if not self.log_checkpoints or not self.started():
            return
        folder = local_folder(path)
        if folder is None:
            logger.info("%s(log_checkpoints=True) logs local checkpoints only; %s is not one", type(self).__name__,
                        path)
            return
        self.log_checkpoint(folder, path)


class BackgroundWriter:
    """Runs a tracker's writes on one thread of its own, in the order submitted, off the training call's path.

    At most ``max_pending`` writes wait (a full queue makes :meth:`submit` wait, at most ``timeout_s``, then raise
    ``TimeoutError``); every wait has a deadline. A write that raises is logged at once (a warning naming ``name``
    and the write, with the traceback) and kept: the next :meth:`submit` raises it (after queueing its own write),
    as do :meth:`flush` and :meth:`close`, so no error is lost silently. The thread is a daemon: what was not
    written when the process dies is lost (:meth:`close` first). Made again after :meth:`close` on the next submit.

    Example:
        >>> writer = BackgroundWriter("example")
        >>> seen = []
        >>> writer.submit(lambda: seen.append(1), "one"); writer.submit(lambda: seen.append(2), "two")
        >>> writer.close(timeout_s=10); seen
        [1, 2]
    """

    def __init__(self, name, max_pending=100, timeout_s=120.0):
        self.name, self.max_pending, self.timeout_s = name, max_pending, timeout_s
        self._queue: queue.Queue[tuple[Callable[[], Any], str] | None] = queue.Queue(max_pending)  # None: stop
        self._thread = None
        self._changed = threading.Condition()
        self._queued = self._completed = 0
        self._error = None  # (description, exception) of a failed write not raised yet

    def pending(self):
        """How many submitted writes have not finished."""
        with self._changed:
            return self._queued - self._completed

    def submit(self, job, description):
        """Queue ``job()`` (``description`` names it in errors); then raise an earlier write's error, if any."""
        with self._changed:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._serve, name=f"raysgd-{self.name}-writer", daemon=True)
                self._thread.start()
            self._queued += 1
        try:
            self._queue.put((job, description), timeout=self.timeout_s)
        except queue.Full:
            with self._changed:
                self._queued -= 1
            raise TimeoutError(f"{self.name}: {self.max_pending} writes still waiting after {self.timeout_s} s; "
                               f"{description} was not queued (is the tracker reachable?)") from None
        self.raise_error()

    def _serve(self):
        while True:
            item = self._queue.get()
            if item is None:
                return
            job, description = item
            try:
                job()
            except BaseException as err:  # noqa: BLE001 (kept and raised in the caller's thread)
                logger.warning("%s: %s failed in the background (raised at the next call or at shutdown)",
                               self.name, description, exc_info=True)
                with self._changed:
                    self._error = self._error or (description, err)
            finally:
                with self._changed:
                    self._completed += 1
                    self._changed.notify_all()

    def raise_error(self):
        """Raise (once) the first write's error not raised yet, as ``RuntimeError`` naming the writer and the write."""
        with self._changed:
            error, self._error = self._error, None
        if error is not None:
            description, err = error
            raise RuntimeError(f"{self.name}: {description} failed in the background: {err}") from err

    def flush(self, timeout_s=None, raise_error=True):
        """Wait until every write submitted so far finished (at most ``timeout_s``, default ``self.timeout_s``:
        then ``TimeoutError``); then raise a failed write's error (unless ``raise_error=False``)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        with self._changed:
            target = self._queued
            if not self._changed.wait_for(lambda: self._completed >= target, timeout=timeout_s):
                raise TimeoutError(f"{self.name}: {target - self._completed} write(s) not finished within "
                                   f"{timeout_s} s")
        if raise_error:
            self.raise_error()

    def close(self, timeout_s=None):
        """:meth:`flush`, then stop the thread (a later :meth:`submit` starts a new one); raises as :meth:`flush`."""
        try:
            self.flush(timeout_s, raise_error=False)
        finally:
            with self._changed:
                thread, self._thread = self._thread, None
            if thread is not None and thread.is_alive():
                try:
                    self._queue.put_nowait(None)  # drained when flush returned; else the daemon is left behind
                except queue.Full:
                    pass
                thread.join(timeout=1.0)
        self.raise_error()
