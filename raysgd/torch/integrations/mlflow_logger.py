"""MLflow as a callback: the trainer's config as params, every result as metrics at ``step=epoch``, checkpoints.

Layer 5 (the edge): mlflow is optional (``pip install "raysgd[mlflow]"``), imported when a logger is made.
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
- With ``log_checkpoints=True`` each durable checkpoint (``storage_path``) that lies in a local folder is
  logged as artifacts under ``checkpoints/<its folder name>``.
- The run ends (``FINISHED``) at ``trainer.shutdown()``.
- With a durable run (``storage_path``) the run id is kept in every checkpoint's marker; a driver that crashed
  and runs again continues the **same** MLflow run, and a step logged before the crash but after the checkpoint
  it resumes from is not logged again (the first value stays): every step appears once.

Example:
    >>> from raysgd.loggers import MLflowLogger  # doctest: +SKIP
    >>> logger = MLflowLogger(tracking_uri="http://127.0.0.1:5000", experiment_name="digits")  # doctest: +SKIP
    >>> trainer = TorchTrainer(training_operator_cls=MyOperator, callbacks=[logger])  # doctest: +SKIP
    >>> check_arguments("", "exp", None, None, False)
    Traceback (most recent call last):
    ...
    TypeError: MLflowLogger: tracking_uri expects None, a URI or a local folder; got ''
"""
import logging
import os
import time

from raysgd import optional
from raysgd.torch.integrations.tracker import EpochLogger, is_number

logger = logging.getLogger(__name__)

_BATCH = 100  # MLflow takes at most this many params (and 1000 metrics) per log_batch call


def check_arguments(tracking_uri, experiment_name, run_name, tags, log_checkpoints):
    """:class:`MLflowLogger`'s checks: every error names the argument, what it expects and the value given."""
    def expect(ok, name, expected, value):
        if not ok:
            raise TypeError(f"MLflowLogger: {name} expects {expected}; got {value!r}")

    expect(tracking_uri is None or (isinstance(tracking_uri, (str, os.PathLike)) and os.fspath(tracking_uri)),
           "tracking_uri", "None, a URI or a local folder", tracking_uri)
    expect(isinstance(experiment_name, str) and experiment_name, "experiment_name", "a non-empty str",
           experiment_name)
    expect(run_name is None or isinstance(run_name, str), "run_name", "None or a str", run_name)
    expect(tags is None or (isinstance(tags, dict) and all(isinstance(k, str) for k in tags)), "tags",
           "None or a dict with str keys", tags)
    expect(isinstance(log_checkpoints, bool), "log_checkpoints", "True or False", log_checkpoints)


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


def flatten(values, prefix=""):
    """``{"a": {"b": 1}}`` -> ``{"a/b": 1}``.

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

    def __init__(self, tracking_uri=None, experiment_name="raysgd", run_name=None, tags=None, log_checkpoints=False):
        check_arguments(tracking_uri, experiment_name, run_name, tags, log_checkpoints)
        self._mlflow = optional.require("mlflow", "raysgd.loggers.MLflowLogger")  # before any actor starts
        self.tracking_uri, self._artifacts = resolve_tracking_uri(tracking_uri)
        self.experiment_name, self.run_name = experiment_name, run_name
        self.tags, self.log_checkpoints = dict(tags or {}), log_checkpoints
        self.run_id = None
        self._client = None
        self._params_logged = False
        self._logged_before = None  # resumed: {metric: its last step already in the run}, read at the first result
        self._resumed_from = None  # the step of the checkpoint resumed from

    def __getstate__(self):
        """Picklable (a Tune trial ships its trainer's options): the module and the client are made again there."""
        return {**self.__dict__, "_mlflow": None, "_client": None}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._mlflow = optional.require("mlflow", "raysgd.loggers.MLflowLogger")

    @property
    def client(self):
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

    def _log_params(self, trainer):
        if self._params_logged:
            return
        config = dict(getattr(trainer, "config", None) or {})
        entities = self._mlflow.entities
        params = [entities.Param(str(k), str(v)[:6000]) for k, v in flatten(config).items()]
        for start in range(0, len(params), _BATCH):
            self.client.log_batch(self.run_id, params=params[start:start + _BATCH])
        self._params_logged = True

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
        """Log a result's numbers as ``<phase>/<name>`` at ``step`` (a step the run already holds is kept)."""
        self._ensure_run()
        self._log_params(trainer)
        before = self._already_logged() if self._resumed_from is not None else {}
        now = int(time.time() * 1000)
        metrics = [self._mlflow.entities.Metric(key, float(value), now, step)
                   for key, value in flatten(result, f"{phase}/").items()
                   if is_number(value) and step > before.get(key, -1)]
        skipped = sum(1 for key in before if key.startswith(f"{phase}/") and step <= before[key])
        if skipped:
            logger.info("MLflow run %s already holds step %d of %d %s metrics (logged before the driver "
                        "stopped): kept as they are", self.run_id, step, skipped, phase)
        for start in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[start:start + 1000])

    # ----------------------------------------------------------------- hooks
    def started(self):
        return self.run_id is not None

    def log_checkpoint(self, folder, path):
        self.client.log_artifacts(self.run_id, folder, artifact_path=f"checkpoints/{os.path.basename(folder)}")

    def on_shutdown(self, trainer):
        if self.run_id is not None:
            self.client.set_terminated(self.run_id, "FINISHED")

    # ----------------------------------------------------------------- a durable run's state
    def state_dict(self):
        """``{"run_id", "step", "params_logged"}``: kept in every durable checkpoint's marker."""
        if self.run_id is None:
            return None
        return {"run_id": self.run_id, "step": self.epoch, "params_logged": self._params_logged}

    def load_state_dict(self, state):
        """Continue the run a durable checkpoint names, from its step."""
        self.run_id = state.get("run_id")
        self.epoch = int(state.get("step") or 0)
        self._params_logged = bool(state.get("params_logged"))
        self._resumed_from = self.epoch
        self._logged_before = None
        if self.run_id is not None:
            self.client.update_run(self.run_id, status="RUNNING")
            logger.info("Continuing MLflow run %s after step %d", self.run_id, self.epoch)
