"""Result logs without Tune: every ``train()``/``validate()`` result appended to CSV and, optionally, TensorBoard.

Helper of layer 7 (:mod:`raysgd.torch.torch_trainer`): standard library; tensorboardX when installed.
``TorchTrainer(..., logdir="runs/exp1")`` opens a :class:`ResultLogger` there; it can also be used on
its own. Files in ``logdir``:

- ``train.csv`` and ``validate.csv``: one row per call, columns ``step`` (the number of ``train()``
  results logged so far, so a validation row lines up with the epoch before it), ``time`` (Unix
  seconds), then every metric as returned (nested dicts such as ``profile`` flattened to
  ``profile/mean_fwd_s``; a result's own ``step`` or ``time`` as ``result/step``, ``result/time``).
  A metric that appears later adds a column (the file is rewritten once).
  An existing file is appended to.
- TensorBoard event files (``tensorboardX``, ``pip install 'raysgd[logging]'``): every numeric
  metric as the scalar ``train/<name>`` or ``validate/<name>`` at ``step``.

A :class:`ResultLogger` is :class:`~raysgd.base.stateful.Stateful`: a durable checkpoint keeps its
``state_dict()`` (the train rows logged), and a resumed run's ``load_state_dict`` drops the rows logged after it.

Example:
    >>> import os, tempfile
    >>> log = ResultLogger(tempfile.mkdtemp(), tensorboard=False)
    >>> log.log("train", {"num_samples": 64, "train_loss": 0.5})
    >>> log.log("validate", {"num_samples": 32, "val_loss": 0.25})
    >>> read_results(log.logdir, "validate")[0]["val_loss"], read_results(log.logdir, "validate")[0]["step"]
    (0.25, 1)
    >>> log.close()
"""
import csv
import logging
import os
import time

from raysgd import optional
from raysgd.base.checks import expect, is_number
from raysgd.callbacks import Callback
from raysgd.torch.integrations.tracker import flatten

logger = logging.getLogger(__name__)

PHASES = ("train", "validate")
_FIXED = ["step", "time"]


def _parse(text):
    """A CSV cell back to what was written: an int, a float, a bool (``True``/``False``, as a bool is written), or
    the text itself (``''`` and a cell missing from a short row are None)."""
    if text is None or text == "":
        return None
    if text in ("True", "False"):
        return text == "True"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    return text


def read_results(logdir, phase="train"):
    """The rows of ``<logdir>/<phase>.csv`` as dicts of numbers (``[]`` when there is no file); ``phase`` is
    ``"train"`` or ``"validate"`` (anything else: ``ValueError``).

    A cell is read back as it was written: an int, a float (``nan`` and ``inf`` too), a bool, else text; an empty
    cell is None. A row cut short (a driver killed while writing it) has None for the cells it lacks; cells past
    the header's columns are left out.

    Example:
        >>> read_results("/nonexistent", "train")
        []
    """
    how = {"caller": "read_results", "call": True}
    expect(isinstance(logdir, (str, os.PathLike)), "logdir", "a directory path", logdir, TypeError, **how)
    expect(phase in PHASES, "phase", f"one of {PHASES}", phase, **how)
    path = os.path.join(os.fspath(logdir), f"{phase}.csv")
    if not os.path.exists(path):
        return []
    with open(path, newline="", encoding="utf-8") as handle:
        return [{key: _parse(value) for key, value in row.items() if key is not None}
                for row in csv.DictReader(handle)]


class ResultLogger:
    """Appends results to ``<logdir>/<phase>.csv`` and to TensorBoard (see the module docstring).

    Args:
        logdir: a directory (created when missing).
        tensorboard: ``"auto"`` (when tensorboardX imports), True (required), or False.

    Example:
        >>> import tempfile
        >>> log = ResultLogger(tempfile.mkdtemp(), tensorboard=False)
        >>> log.log("train", {"train_loss": 0.5}); log.log("train", {"train_loss": 0.25})
        >>> [row["train_loss"] for row in read_results(log.logdir)]
        [0.5, 0.25]
    """

    def __init__(self, logdir, *, tensorboard="auto"):
        how = {"caller": "ResultLogger", "call": True}
        expect(isinstance(logdir, (str, os.PathLike)), "logdir", "a directory path", logdir, TypeError, **how)
        expect(isinstance(tensorboard, bool) or tensorboard in ("auto",), "tensorboard", "'auto', True or False",
               tensorboard, **how)  # not 0 or 1: 0 would open TensorBoard (only ``False`` is "no")
        self.logdir = os.path.abspath(os.fspath(logdir))
        os.makedirs(self.logdir, exist_ok=True)
        self._columns = {}
        self._train_steps = len(read_results(self.logdir, "train"))
        self._writer = self._open_tensorboard(tensorboard)

    def _open_tensorboard(self, wanted, purge_step=None):
        if wanted is False:
            return None
        try:
            tensorboardx = optional.require("tensorboardX", "ResultLogger(tensorboard=True)")
        except optional.MissingExtra as err:
            if wanted is True:
                raise ValueError(str(err)) from err
            logger.info("tensorboardX is not installed: results go to CSV only (%s; %s)", self.logdir,
                        optional.install_hint("tensorboardX"))
            return None
        return tensorboardx.SummaryWriter(logdir=self.logdir, purge_step=purge_step)

    @property
    def tensorboard(self):
        """Whether results also go to TensorBoard."""
        return self._writer is not None

    def log(self, phase, result):
        """Append one result dict of ``phase`` (``"train"`` or ``"validate"``)."""
        how = {"caller": "ResultLogger.log", "call": True}
        expect(phase in PHASES, "phase", f"one of {PHASES}", phase, **how)
        expect(isinstance(result, dict), "result", "a dict of metrics", result, TypeError, got=type(result).__name__,
               **how)
        if phase == "train":
            self._train_steps += 1
        now = time.time()
        row = {"step": self._train_steps, "time": now,
               **{(f"result/{key}" if key in _FIXED else key): value for key, value in flatten(result).items()}}
        self._append_csv(phase, row)
        if self._writer is not None:
            for key, value in row.items():
                if key not in _FIXED and is_number(value):
                    self._writer.add_scalar(f"{phase}/{key}", float(value), global_step=self._train_steps,
                                           walltime=now)  # float: an int past int64 made tensorboardX raise
            self._writer.flush()

    def _append_csv(self, phase, row):
        path = os.path.join(self.logdir, f"{phase}.csv")
        columns = self._columns.get(phase)
        if columns is None:  # first row of this run: continue the file's header, if any
            columns = []
            if os.path.exists(path):
                with open(path, newline="", encoding="utf-8") as handle:
                    columns = next(csv.reader(handle), [])
            self._columns[phase] = columns
        new = [key for key in row if key not in columns]
        if new or not columns:
            self._rewrite(path, columns + new)
            columns = self._columns[phase] = columns + new
        with open(path, "a", newline="", encoding="utf-8") as handle:
            csv.DictWriter(handle, fieldnames=columns).writerow(row)

    def _rewrite(self, path, columns):
        """Write the file again under a wider header (atomically: temp file, then rename)."""
        rows = []
        if os.path.exists(path):
            with open(path, newline="", encoding="utf-8") as handle:
                rows = list(csv.DictReader(handle))
        temp = f"{path}.tmp"
        with open(temp, "w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=columns, extrasaction="ignore")  # cells past the header
            writer.writeheader()
            writer.writerows(rows)
        os.replace(temp, path)

    @property
    def train_rows(self):
        """How many ``train`` results are logged (the ``step`` of the last one)."""
        return self._train_steps

    def state_dict(self):
        """What a checkpoint keeps of the log (:class:`~raysgd.base.stateful.Stateful`): ``{"train_rows": n}``, the
        ``train`` results logged when it was taken.

        Example:
            >>> import tempfile
            >>> log = ResultLogger(tempfile.mkdtemp(), tensorboard=False)
            >>> log.log("train", {"train_loss": 1}); log.state_dict()
            {'train_rows': 1}
        """
        return {"train_rows": self._train_steps}

    def load_state_dict(self, state):
        """Go back to what :meth:`state_dict` returned (also its older form, the row count alone): the rows logged
        after it are dropped (:meth:`rewind`), so a resumed run that redoes them logs each once.

        Example:
            >>> import tempfile
            >>> log = ResultLogger(tempfile.mkdtemp(), tensorboard=False)
            >>> log.log("train", {"train_loss": 1}); saved = log.state_dict(); log.log("train", {"train_loss": 2})
            >>> log.load_state_dict(saved); len(read_results(log.logdir))
            1
        """
        rows = state.get("train_rows") if isinstance(state, dict) else state
        expect(isinstance(rows, int) and not isinstance(rows, bool) and rows >= 0, "state",
               'a dict {"train_rows": an int >= 0}', state, TypeError, caller="ResultLogger.load_state_dict", call=True)
        self.rewind(rows)

    def rewind(self, train_rows):
        """Forget what was logged after the first ``train_rows`` train results (a resumed run redoes it).

        ``train.csv`` keeps its first ``train_rows`` rows, ``validate.csv`` its rows with ``step <= train_rows``;
        TensorBoard hides the later events (``purge_step``).

        Example:
            >>> import tempfile
            >>> log = ResultLogger(tempfile.mkdtemp(), tensorboard=False)
            >>> for loss in (3, 2, 1):
            ...     log.log("train", {"train_loss": loss})
            >>> log.rewind(1); log.log("train", {"train_loss": 0})
            >>> [(row["step"], row["train_loss"]) for row in read_results(log.logdir)]
            [(1, 3), (2, 0)]
        """
        for phase in PHASES:
            path = os.path.join(self.logdir, f"{phase}.csv")
            rows = read_results(self.logdir, phase)
            kept = rows[:train_rows] if phase == "train" else [r for r in rows if (r.get("step") or 0) <= train_rows]
            if len(kept) < len(rows):
                logger.info("Result log %s: dropping %d rows logged after the checkpoint", path, len(rows) - len(kept))
                with open(path, newline="", encoding="utf-8") as handle:
                    columns = next(csv.reader(handle), [])
                temp = f"{path}.tmp"
                with open(temp, "w", newline="", encoding="utf-8") as handle:
                    writer = csv.DictWriter(handle, fieldnames=columns)
                    writer.writeheader()
                    writer.writerows([{k: ("" if v is None else v) for k, v in row.items()} for row in kept])
                os.replace(temp, path)
        self._train_steps = train_rows
        if self._writer is not None:
            self._writer.close()
            self._writer = self._open_tensorboard(True, purge_step=train_rows + 1)

    def close(self):
        """Flush and close the TensorBoard writer (the CSV files are closed after every row)."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()


class ResultLogCallback(Callback):
    """``TorchTrainer(logdir=...)`` as a callback: every result goes to the :class:`ResultLogger` ``log``.

    Example:
        >>> import tempfile
        >>> log = ResultLogger(tempfile.mkdtemp(), tensorboard=False)
        >>> ResultLogCallback(log).on_train_result(None, {"train_loss": 0.5})
        >>> read_results(log.logdir)[0]["train_loss"]
        0.5
    """

    def __init__(self, log):
        self.log = log

    def on_train_result(self, trainer, result):
        self.log.log("train", result)

    def on_validate_result(self, trainer, result):
        self.log.log("validate", result)


def open_result_log(logdir):
    """``TorchTrainer(logdir=...)``: None, a :class:`ResultLogger`, or a path to open one in.

    Example:
        >>> open_result_log(None) is None
        True
    """
    if logdir is None or isinstance(logdir, ResultLogger):
        return logdir
    expect(isinstance(logdir, (str, os.PathLike)), "logdir", "a directory path, a ResultLogger or None", logdir,
           TypeError, caller="TorchTrainer", call=True)
    return ResultLogger(logdir)
