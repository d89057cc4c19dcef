"""MLflow as a callback: the trainer's config as params, every result as metrics at ``step=epoch``, checkpoints.

Layer 6 (the edge): mlflow is optional (``pip install "raysgd[mlflow]"``), imported when a logger is made.
:class:`MLflowLogger` talks to MLflow through an ``MlflowClient`` of its own (never the global ``mlflow`` run),
so several trainers in one process log to their own runs:

- ``tracking_uri`` as a plain local folder means MLflow's sqlite store in it (``<folder>/mlflow.db``, artifacts in
  ``<folder>/artifacts``; open it with ``mlflow ui --backend-store-uri sqlite:///<folder>/mlflow.db``): MLflow 3
  refuses its old file store unless ``MLFLOW_ALLOW_FILE_STORE=true``. A ``file:`` URI is MLflow's file store.
- The run is created at the first result (in ``experiment_name``, made when missing), with ``run_name`` and
  ``tags``; the trainer's ``config`` becomes its params then (values as text; nested dicts flattened to
  ``a/b``).
- Every ``train()`` result's numbers become metrics ``train/<name>`` at ``step=result["epoch"]``; every
  ``validate()`` result's become ``validate/<name>`` at the epoch of the last ``train()`` (0 before any).
- A metric or param name MLflow refuses (one would fail the step's whole batch) is logged under
  :func:`mlflow_name`'s form of it (``acc@1`` as ``acc_1``), named in a warning once; a tag name it refuses is a
  ``ValueError`` when the logger is made.
- With ``log_checkpoints=True`` each durable checkpoint (``storage_path``) that lies in a local folder is
  logged as artifacts under ``checkpoints/<its folder name>``.
- The run ends (``FINISHED``) at ``trainer.shutdown()``.
- With a durable run (``storage_path``) the run id is kept in every checkpoint's marker; a driver that crashed
  and runs again continues the **same** MLflow run, and a step logged before the crash but after the checkpoint
  it resumes from is not logged again (the first value stays): every step appears once.
- Every write to MLflow runs on a thread of the logger's own (:class:`~raysgd.torch.integrations.tracker.
  BackgroundWriter`: in order, at most ``MAX_PENDING`` waiting, every wait at most ``TIMEOUT_S``), so a result
  costs the training loop a queue put, not a round trip to the tracking server. A write that fails is logged at
  once and raised by the logger's next hook (logged by the trainer's callback list) or by ``shutdown()``'s
  ``on_shutdown``; ``shutdown()`` waits for every write. The only waits on the call's path: a full queue, and,
  with ``storage_path``, the first checkpoint's marker waiting for the run to exist (its id goes in the marker).
  The results queued but not yet written when a marker is taken go in it too (``unwritten``): a run resumed
  from it writes those the server does not hold, so a driver killed with writes queued loses no step.

Example:
    >>> from raysgd.loggers import MLflowLogger  # doctest: +SKIP
    >>> logger = MLflowLogger(tracking_uri="http://127.0.0.1:5000", experiment_name="digits")  # doctest: +SKIP
    >>> trainer = TorchTrainer(training_operator_cls=MyOperator, callbacks=[logger])  # doctest: +SKIP
    >>> check_arguments("", "exp", None, None, False)
    Traceback (most recent call last):
    ...
    TypeError: MLflowLogger: tracking_uri expects None, a URI or a local folder; got ''
"""
from __future__ import annotations

import hashlib
import itertools
import logging
import os
import re
import threading
import time

from raysgd import optional
from raysgd.base.checks import expect
from raysgd.torch.integrations.tracker import BackgroundWriter, EpochLogger, flatten, numbers
from typing import Any

logger = logging.getLogger(__name__)

_BATCH = 100  # MLflow takes at most this many params (and 1000 metrics) per log_batch call
#: The longest name MLflow takes for a metric, a param or a tag.
MAX_NAME = 250
_REFUSED = re.compile(r"[^/\w.\- :]")  # what MLflow refuses in a name: not a letter, digit, _ - . space : or /
#: Writes (results, the run's start and end, checkpoints) that may wait for the logger's thread.
MAX_PENDING = 100
#: The longest any wait for the logger's thread takes (a full queue, a flush, ``shutdown()``), in seconds.
TIMEOUT_S = 120.0


def check_arguments(tracking_uri, experiment_name, run_name, tags, log_checkpoints):
    """:class:`MLflowLogger`'s checks: every error names the argument, what it expects and the value given."""
    how = {"error": TypeError, "caller": "MLflowLogger"}
    expect(tracking_uri is None or (isinstance(tracking_uri, (str, os.PathLike)) and os.fspath(tracking_uri)),
           "tracking_uri", "None, a URI or a local folder", tracking_uri, **how)
    expect(isinstance(experiment_name, str) and experiment_name, "experiment_name", "a non-empty str",
           experiment_name, **how)
    expect(run_name is None or isinstance(run_name, str), "run_name", "None or a str", run_name, **how)
    expect(tags is None or (isinstance(tags, dict) and all(isinstance(k, str) for k in tags)), "tags",
           "None or a dict with str keys", tags, **how)
    refused = [key for key in tags or {} if mlflow_name(key) != key]
    expect(not refused, "tags", f"keys MLflow takes as names (letters, digits, _ - . space : and /, at most "
           f"{MAX_NAME} characters)", tags, error=ValueError, caller="MLflowLogger",
           got=f"{tags!r} (refused: {refused!r})")
    expect(isinstance(log_checkpoints, bool), "log_checkpoints", "True or False", log_checkpoints, **how)


def resolve_tracking_uri(tracking_uri):
    """``(tracking URI, artifact location of new experiments or None)``: a plain folder becomes its sqlite store.

    Example:
        >>> resolve_tracking_uri("/tmp/runs")
        ('sqlite:////tmp/runs/mlflow.db', 'file:///tmp/runs/artifacts')
        >>> resolve_tracking_uri("http://127.0.0.1:5000")
        ('http://127.0.0.1:5000', None)
    """
    if tracking_uri is None:
        return None, None
    uri = os.fspath(tracking_uri)
    if "://" in uri or uri.startswith(("file:", "databricks", "sqlite:")):
        return uri, None
    folder = os.path.abspath(uri)
    os.makedirs(folder, exist_ok=True)
    return f"sqlite:///{folder}/mlflow.db", f"file://{folder}/artifacts"


def mlflow_name(key):
    """``key`` as a name MLflow takes for a metric or a param: every character it refuses becomes ``_`` (it takes
    letters, digits, ``_ - . : /`` and spaces), an empty, ``.`` or ``..`` part between slashes becomes ``_``, and a
    name over ``MAX_NAME`` characters is cut, ending in a hash of the whole name (so two long names stay two).

    Example:
        >>> mlflow_name("train/acc@1"), mlflow_name("train/profile/"), mlflow_name("val top-1: acc")
        ('train/acc_1', 'train/profile/_', 'val top-1: acc')
        >>> len(mlflow_name("x" * 300))
        250
    """
    key = str(key)
    name = "/".join(part if part.strip(".") else "_" * max(len(part), 1)
                    for part in _REFUSED.sub("_", key).split("/"))
    if name.startswith(".."):  # MLflow refuses a name that starts like a parent folder
        name = "_" + name[1:]
    if len(name) > MAX_NAME:
        digest = hashlib.sha1(key.encode("utf-8", "surrogatepass")).hexdigest()[:8]
        name = f"{name[:MAX_NAME - len(digest) - 1]}-{digest}"
    return name


class MLflowLogger(EpochLogger):
    """Logs a trainer's run to MLflow (see the module docstring).

    Args:
        tracking_uri: an MLflow tracking server (``http://host:port``), a database URI, or a local folder (a
            file store); None: MLflow's default (``MLFLOW_TRACKING_URI``).
        experiment_name: the experiment (created when missing). ``run_name``, ``tags``: the run's.
        log_checkpoints: log each local durable checkpoint as artifacts.

    Example:
        >>> MLflowLogger(experiment_name="exp", tags=["a"])  # doctest: +SKIP
        Traceback (most recent call last):
        TypeError: MLflowLogger: tags expects None or a dict with str keys; got ['a']
    """

    _resumed_from: int | None  # (set in __init__: typed here)

    def __init__(self, tracking_uri: str | None = None, experiment_name: str = "raysgd", run_name: str | None = None,
                 tags: dict[str, str] | None = None, log_checkpoints: bool = False) -> None:
        check_arguments(tracking_uri, experiment_name, run_name, tags, log_checkpoints)
        self._mlflow = optional.require("mlflow", "raysgd.loggers.MLflowLogger")  # before any actor starts
        self.tracking_uri, self._artifacts = resolve_tracking_uri(tracking_uri)
        self.experiment_name, self.run_name = experiment_name, run_name
        self.tags, self.log_checkpoints = dict(tags or {}), log_checkpoints
        self.run_id = None
        self._client = None
        self._params_logged = False  # written (on the logger's thread)
        self._started = False  # the run's start is queued (the first result)
        self._params: dict | None = None  # the trainer's config, read at the first result (logged as params)
        # resumed: {metric: its last step already in the run}, read at the first result
        self._logged_before: dict[str, int] | None = None
        self._resumed_from = None  # the step of the checkpoint resumed from
        self._renamed: set[str] = set()  # the names MLflow refuses that a warning has named already
        self._make_writer()

    def _make_writer(self):
        self._writer = BackgroundWriter("MLflowLogger", max_pending=MAX_PENDING, timeout_s=TIMEOUT_S)
        self._lock = threading.Lock()
        self._unwritten = {}  # number -> a queued result not written yet: {"phase", "step", "metrics", "time"}
        self._numbers = itertools.count()

    def __getstate__(self):
        """Picklable (a Tune trial ships its trainer's options): the module, the client and the writer are made
        again there."""
        state = {**self.__dict__, "_mlflow": None, "_client": None}
        for name in ("_writer", "_lock", "_unwritten", "_numbers"):
            state.pop(name, None)
        return state

    def __setstate__(self, state):
        self.__dict__.update({"_renamed": set(), **state})
        self._mlflow = optional.require("mlflow", "raysgd.loggers.MLflowLogger")
        self._make_writer()

    @property
    def client(self) -> Any:
        """The ``mlflow.MlflowClient`` this logger uses (made on first use)."""
        if self._client is None:
            self._client = self._mlflow.MlflowClient(tracking_uri=self.tracking_uri)
        return self._client

    # ----------------------------------------------------------------- the run
    def _ensure_run(self):
        if self.run_id is not None:
            return self.run_id
        experiment = self.client.get_experiment_by_name(self.experiment_name)
        experiment_id = experiment.experiment_id if experiment is not None else \
            self.client.create_experiment(self.experiment_name, artifact_location=self._artifacts)
        run = self.client.create_run(experiment_id, run_name=self.run_name,
                                     tags={str(k): str(v) for k, v in self.tags.items()})
        self.run_id = run.info.run_id
        logger.info("MLflow run %s in experiment %r (%s)", self.run_id, self.experiment_name,
                    self.tracking_uri or "MLflow's default tracking URI")
        return self.run_id

    def _log_params(self, config):
        if self._params_logged:
            return
        entities = self._mlflow.entities
        params = [entities.Param(k, str(v)[:6000]) for k, v in self._named(flatten(config), "param").items()]
        for start in range(0, len(params), _BATCH):
            self.client.log_batch(self.run_id, params=params[start:start + _BATCH])
        self._params_logged = True

    def _named(self, values, kind):
        """``values`` under names MLflow takes (:func:`mlflow_name`; one refused name would fail the whole batch, so
        the step's other metrics or the run's params would be lost). A renamed key is named in a warning once; a
        renamed key whose new name another key of ``values`` has is left out (warned about each time)."""
        named = {key: value for key, value in values.items() if mlflow_name(key) == key}
        for key, value in values.items():
            name = mlflow_name(key)
            if name == key:
                continue
            if name in named:
                logger.warning("MLflowLogger: %s %r is not logged: MLflow refuses the name and %r, its form that "
                               "MLflow takes, is logged already", kind, key, name)
                continue
            if key not in self._renamed:
                self._renamed.add(key)
                logger.warning("MLflowLogger: MLflow refuses the %s name %r (it takes letters, digits, _ - . : / and "
                               "spaces, at most %d characters): logged as %r", kind, key, MAX_NAME, name)
            named[name] = value
        return named

    def _already_logged(self):
        """Resumed: ``{metric: last step}`` of what the run holds past the checkpoint's step (logged before the
        crash), read once."""
        if self._logged_before is None:
            self._logged_before = {}
            run = self.client.get_run(self.run_id)
            for key in run.data.metrics:
                steps = [m.step for m in self.client.get_metric_history(self.run_id, key)]
                if steps:
                    self._logged_before[key] = max(steps)
        return self._logged_before

    def log_result(self, trainer, phase, result, step):
        """Queue a result's numbers as ``<phase>/<name>`` at ``step`` (a step the run already holds is kept); the
        first result also queues the run's start and the trainer's config as its params."""
        metrics = {key: float(value) for key, value in numbers(result, f"{phase}/").items()}
        entry = {"phase": phase, "step": int(step), "time": int(time.time() * 1000),
                 "metrics": self._named(metrics, "metric")}
        if not self._started:
            self._started = True
            self._params = dict(getattr(trainer, "config", None) or {})  # read now, on the caller's thread
        self._queue_result(entry)

    def _queue_result(self, entry):
        with self._lock:
            number = next(self._numbers)
            self._unwritten[number] = entry

        def write():
            try:
                self._write_result(entry)
            finally:
                with self._lock:
                    self._unwritten.pop(number, None)

        self._writer.submit(write, f"writing {entry['phase']} step {entry['step']} to MLflow run "
                                   f"{self.run_id or '(new)'}")

    def _write_result(self, entry):
        """On the logger's thread: start the run and log its params (until both are done), then the metrics."""
        self._ensure_run()
        if self._params is not None:
            self._log_params(self._params)
        phase, step = entry["phase"], entry["step"]
        before = self._already_logged() if self._resumed_from is not None else {}
        metrics = [self._mlflow.entities.Metric(key, value, entry["time"], step)
                   for key, value in entry["metrics"].items() if step > before.get(key, -1)]
        skipped = sum(1 for key in before if key.startswith(f"{phase}/") and step <= before[key])
        if skipped:
            logger.info("MLflow run %s already holds step %d of %d %s metrics (logged before the driver "
                        "stopped): kept as they are", self.run_id, step, skipped, phase)
        for start in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[start:start + 1000])

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every queued write is in MLflow (at most ``timeout_s``, default ``TIMEOUT_S``: then
        ``TimeoutError``); raises a failed write's error.

        Example:
            >>> mlflow_logger.flush(timeout_s=30)  # doctest: +SKIP
        """
        self._writer.flush(timeout_s)

    # ----------------------------------------------------------------- hooks
    def started(self):
        return self._started or self.run_id is not None

    def log_checkpoint(self, folder, path):
        """On the checkpoint writer's thread: queued after the results before it, and waited for (the folder may be
        pruned once newer checkpoints are written)."""
        name = os.path.basename(folder)
        self._writer.submit(lambda: self.client.log_artifacts(self.run_id, folder, artifact_path=f"checkpoints/{name}"),
                            f"logging checkpoint {name} as artifacts")
        self._writer.flush()

    def on_shutdown(self, trainer: Any) -> None:
        """End the run (``FINISHED``) once every queued write is done; raises a failed write's error."""
        if self.started():
            self._writer.submit(lambda: self.client.set_terminated(self.run_id, "FINISHED"),
                                "ending the MLflow run")
        self._writer.close()

    # ----------------------------------------------------------------- a durable run's state
    def state_dict(self) -> dict | None:
        """``{"run_id", "step", "params_logged", "unwritten"}``: kept in every durable checkpoint's marker
        (``unwritten``: the results queued and not yet written, written on resume where the run lacks them).
        Waits (at most ``TIMEOUT_S``) only while the run is being started: its id must be in the marker."""
        if self.run_id is None and self._started:
            try:
                self._writer.flush(raise_error=False)  # the first result: the run's start is queued
            except TimeoutError:
                logger.warning("MLflowLogger: the MLflow run was not started within %s s; this checkpoint does not "
                               "name it", TIMEOUT_S)
        if self.run_id is None:
            return None
        with self._lock:
            unwritten = [dict(entry) for _, entry in sorted(self._unwritten.items())]
        return {"run_id": self.run_id, "step": self.epoch, "params_logged": self._params_logged,
                "unwritten": unwritten}

    def load_state_dict(self, state: dict) -> None:
        """Continue the run a durable checkpoint names, from its step; write its unwritten results the run lacks.
        Writes this logger queued before (its run open in this process: a restarted training function) land
        first, so what the run holds is read whole."""
        if self._writer.pending():
            try:
                self._writer.flush(raise_error=False)
            except TimeoutError as err:
                logger.warning("MLflowLogger: %s; a step written after it may be logged twice", err)
        self.run_id = state.get("run_id")
        self.epoch = int(state.get("step") or 0)
        self._params_logged = bool(state.get("params_logged"))
        self._started = self._params_logged  # else the next result logs the config as params again
        self._resumed_from = self.epoch
        self._logged_before = None
        if self.run_id is not None:
            run_id = self.run_id
            self._writer.submit(lambda: self.client.update_run(run_id, status="RUNNING"),
                                f"marking MLflow run {run_id} running again")
            logger.info("Continuing MLflow run %s after step %d", self.run_id, self.epoch)
            for entry in state.get("unwritten") or ():
                self._queue_result(entry)
