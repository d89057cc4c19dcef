"""Ray Train's ``TorchTrainer``: a facade that checks its configs and runs the training function on raysgd's runtime.

Part of :mod:`raysgd.train` (layer 7, beside :mod:`raysgd.torch.torch_trainer`). ``fit()`` hands the run to the
same :class:`~raysgd.torch.execution.controller.RunController` and worker group as the operator API, with
:class:`~raysgd.train.function_worker.FunctionWorker` workers: one call, ``run_loop``, runs
``train_loop_per_worker`` on every rank. What the operator API gets, the function gets: its ``report()`` is the
run's commit point (every rank's checkpoint files, written from their nodes: :mod:`raysgd.train.reporting`);
after a failure the controller re-forms the group from the survivors (warm spares take vacant ranks, as many as
fit for a ``(min, max)`` range), and the function runs again from the newest good checkpoint
(:mod:`raysgd.train.commits`), its prepared loaders resuming their epoch at the data cursor; a SIGTERM, a draining
node or room to grow stops the ranks at the next report; the failure policy
(:mod:`raysgd.torch.fault_tolerance.failure_policy`) decides with ``FailureConfig`` (an error of the function is
retried too, as in Ray Train); callbacks, loggers and Ray metrics hear every report, checkpoint, failure and resize.
A new ``fit()`` (or the script run again) with the same ``RunConfig(name, storage_path)`` resumes from the newest
checkpoint.

Example:
    >>> TorchTrainer(lambda: None, scaling_config={"num_workers": 2})
    Traceback (most recent call last):
    ...
    TypeError: TorchTrainer(scaling_config=...) expects a raysgd.train.ScalingConfig (ScalingConfig(num_workers=2)); got dict {'num_workers': 2}
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time

import ray

from raysgd import logs
from raysgd.base.checks import argument_error, expect, is_path
from raysgd.base.paths import local_path
from raysgd.callbacks import Callback, CallbackList
from raysgd.torch.errors import WorkerFailure, rank_of
from raysgd.torch.execution import cluster_state, shipping
from raysgd.torch.execution.controller import RunController
from raysgd.torch.execution.worker_group import WorkerGroup
from raysgd.torch.fault_tolerance import failure_policy, recovery
from raysgd.torch.integrations import progress
from raysgd.torch.integrations.ray_metrics import RayMetrics
from raysgd.torch.restart_points.restart_point import this_node
from raysgd.torch.storage import durable, filesystem
from raysgd.train import retention
from raysgd.train.callback import TrainRunContext, UserCallbacks, split_callbacks
from raysgd.train.checkpoint import Checkpoint
from raysgd.train.commits import ReportCommits, complete_checkpoints
from raysgd.train.config import RunConfig, ScalingConfig, TorchConfig
from raysgd.train.errors import ResourcesError, WorkerGroupError
from raysgd.train.function_worker import FunctionWorker, signature_problem
from raysgd.train.result import Result
from typing import Any, Callable

logger = logging.getLogger(__name__)

_START = ""  # where the callbacks are before any report of a fit(): the name of no checkpoint


#: How the constructor's errors name an argument and its value: ``TorchTrainer(run_config=...) expects ...; got dict
#: {...}`` (:func:`raysgd.base.checks.expect`).
_ARGUMENT = {"error": TypeError, "caller": "TorchTrainer", "call": True, "typed": True}


class TorchTrainer:
    """Runs ``train_loop_per_worker`` on ``scaling_config.num_workers`` workers (see the module docstring).

    Args:
        train_loop_per_worker: ``fn(config)`` or ``fn()``, run on every worker.
        train_loop_config: the dict passed to it.
        scaling_config: :class:`~raysgd.train.config.ScalingConfig`.
        run_config: :class:`~raysgd.train.config.RunConfig` (``name``, ``storage_path``, ``failure_config``,
            ``checkpoint_config``, ``callbacks``).
        datasets: ``{name: ray.data.Dataset}``, split among the workers (``get_dataset_shard(name)``).
        torch_config: :class:`~raysgd.train.config.TorchConfig` (backend, process-group timeout).
        resume_from_checkpoint: a :class:`Checkpoint` to start from when the run folder has none yet.

    Example:
        >>> def train_func(config):  # doctest: +SKIP
        ...     raysgd.train.report({"loss": 0.0})
        >>> result = TorchTrainer(train_func, scaling_config=ScalingConfig(num_workers=2)).fit()  # doctest: +SKIP
    """

    def __init__(self, train_loop_per_worker: Callable[..., Any], *, train_loop_config: dict | None = None,
                 scaling_config: ScalingConfig | None = None, run_config: RunConfig | None = None,
                 datasets: dict[str, Any] | None = None, torch_config: TorchConfig | None = None,
                 resume_from_checkpoint: Checkpoint | None = None, dataset_config: object = None,
                 metadata: dict | None = None) -> None:
        expect(callable(train_loop_per_worker), "train_loop_per_worker", "a function fn(config) or fn()",
               train_loop_per_worker, **_ARGUMENT)
        problem = signature_problem(train_loop_per_worker)  # else every worker's call raises TypeError, retried
        if problem is not None:
            name = getattr(train_loop_per_worker, "__qualname__", None) or repr(train_loop_per_worker)
            raise argument_error("train_loop_per_worker", "a function fn(config) or fn() (0 or 1 required "
                                 "arguments, as in Ray Train)", train_loop_per_worker, ValueError,
                                 caller="TorchTrainer", call=True, got=f"{name}, which takes {problem}")
        expect(train_loop_config is None or isinstance(train_loop_config, dict), "train_loop_config", "None or a dict",
               train_loop_config, **_ARGUMENT)
        expect(scaling_config is None or isinstance(scaling_config, ScalingConfig), "scaling_config",
               "a raysgd.train.ScalingConfig (ScalingConfig(num_workers=2))", scaling_config, **_ARGUMENT)
        expect(run_config is None or isinstance(run_config, RunConfig), "run_config",
               "a raysgd.train.RunConfig (RunConfig(name=..., storage_path=...))", run_config, **_ARGUMENT)
        expect(datasets is None or (isinstance(datasets, dict) and all(
            isinstance(k, str) and hasattr(v, "streaming_split") for k, v in datasets.items())), "datasets",
               "None or a dict {name: ray.data.Dataset}", datasets, **_ARGUMENT)
        expect(torch_config is None or isinstance(torch_config, TorchConfig), "torch_config",
               "None or a raysgd.train.torch.TorchConfig", torch_config, **_ARGUMENT)
        expect(resume_from_checkpoint is None or isinstance(resume_from_checkpoint, Checkpoint),
               "resume_from_checkpoint", "None or a raysgd.train.Checkpoint", resume_from_checkpoint, **_ARGUMENT)
        # the workers open it by its uri: a path inside a remote filesystem object has none (each worker failed)
        expect(resume_from_checkpoint is None or resume_from_checkpoint.uri is not None, "resume_from_checkpoint",
               "a Checkpoint the workers can open: a local directory, or made from a URI (Checkpoint('s3://bucket/"
               "run/checkpoint_000002?region=...'))", resume_from_checkpoint,
               **{**_ARGUMENT, "error": ValueError, "typed": False,
                  "got": f"{resume_from_checkpoint!r}, made from a path inside a filesystem object (no URI)"})
        if dataset_config is not None:
            raise NotImplementedError("TorchTrainer(dataset_config=...) is not supported by raysgd.train: every "
                                      "dataset is split equally among the workers (streaming_split)")
        self.train_loop_per_worker = train_loop_per_worker
        self.train_loop_config = dict(train_loop_config or {})
        self.scaling_config = scaling_config or ScalingConfig()
        self.run_config = run_config or RunConfig()
        self.torch_config = torch_config or TorchConfig()
        self.datasets = dict(datasets or {})
        self.resume_from_checkpoint = resume_from_checkpoint
        self.metadata = metadata
        self._controller: RunController | None = None
        self._last_report_at: float | None = None
        self.last_call_s: float | None = None  # seconds between the last two reports (what Ray metrics' rates read)
        self.last_commit_latency_s = None  # the last checkpointed report's seconds, as rank 0 measured them
        self.last_checkpoint_s = None

    # ----------------------------------------------------------------- restoring a run
    @classmethod
    def can_restore(cls, path: str | os.PathLike) -> bool:
        """Whether the run folder ``path`` (``storage_path/name``, a folder or URI) holds a complete checkpoint a
        training function reported, so :meth:`restore` would resume from it.

        Ray Train 2.58 deprecates ``restore`` and ``can_restore`` (a run with the same ``RunConfig(name,
        storage_path)`` resumes by itself there, as here); raysgd keeps both working.

        Example:
            >>> TorchTrainer.can_restore("/no/such/run")
            False
        """
        expect(is_path(path), "path", "a run folder's path or URI", path, TypeError, "TorchTrainer.can_restore",
               call=True, typed=True)
        storage = filesystem.CheckpointStorage(os.fspath(path), None, marker=filesystem.REPORT_MARKER)
        return bool(complete_checkpoints(storage))

    @classmethod
    def restore(cls, path: str | os.PathLike, train_loop_per_worker: Callable[..., Any],
                **kwargs: Any) -> TorchTrainer:
        """A trainer resuming the run folder ``path`` (``storage_path/name``): ``fit()`` starts from its newest good
        checkpoint. ``train_loop_per_worker`` and the other arguments are as for :class:`TorchTrainer` (raysgd keeps
        no pickled trainer in the folder); a ``run_config`` given keeps its other fields, its name and storage path
        become the folder's. A folder that holds no reported checkpoint (another tool's, or none yet) is refused
        with a ``ValueError`` before any actor starts.

        Example:
            >>> trainer = TorchTrainer.restore("/data/runs/exp", train_func)  # doctest: +SKIP
            >>> result = trainer.fit()  # doctest: +SKIP
        """
        expect(is_path(path), "path", "a run folder's path or URI", path, TypeError, "TorchTrainer.restore", call=True,
               typed=True)
        text = os.fspath(path)
        expect(cls.can_restore(text), "path", "the folder of a raysgd.train run holding a complete reported "
               f"checkpoint (checkpoint_NNNNNN/ with its {filesystem.REPORT_MARKER})", text,
               caller="TorchTrainer.restore", call=True, got=f"{text!r}, which holds none")
        local = local_path(text)  # "exp", ".", "~/runs/exp": made absolute first, as the run's storage reads them
        if local is not None:
            storage_path, name = os.path.split(local)
        else:
            base, query = text.split("?", 1) if "?" in text else (text, None)
            storage_path, name = base.rstrip("/").rsplit("/", 1)
            storage_path = f"{storage_path}?{query}" if query else storage_path
        run_config = kwargs.pop("run_config", None)
        expect(run_config is None or isinstance(run_config, RunConfig), "run_config",
               "None or a raysgd.train.RunConfig", run_config, **{**_ARGUMENT, "caller": "TorchTrainer.restore"})
        run_config = dataclasses.replace(run_config or RunConfig(), name=name, storage_path=storage_path)
        return cls(train_loop_per_worker, run_config=run_config, **kwargs)

    # ----------------------------------------------------------------- what callbacks read
    @property
    def config(self) -> dict | None:
        """The training function's config (``train_loop_config``), as loggers log it."""
        return self.train_loop_config

    @property
    def worker_group(self) -> WorkerGroup | None:
        """The running :class:`~raysgd.torch.execution.worker_group.WorkerGroup` (None outside ``fit()``)."""
        return self._controller.group if self._controller is not None else None

    # ----------------------------------------------------------------- fit
    def _storage(self):
        """The run folder's checkpoint storage, checked writable (a clear error naming ``storage_path``), pruned as
        ``CheckpointConfig`` says (:mod:`raysgd.train.retention`: the best by score, or the newest; never the
        latest)."""
        run = self.run_config
        config = run.checkpoint_config

        def keep(complete):
            entries = [(index, marker.get("metrics", {})) for index, marker in complete]
            return {index for index, _ in complete} - set(retention.checkpoints_to_delete(entries, config))

        root = filesystem.child_uri(run.storage_path, run.name)
        storage = filesystem.CheckpointStorage(root, num_to_keep=config.num_to_keep, marker=filesystem.REPORT_MARKER,
                                               keep=keep)
        try:
            storage.check_writable()
        except ValueError as err:
            raise argument_error("storage_path", "a folder or URI this process can write", run.storage_path,
                                 caller="RunConfig", call=True, got=f"{run.storage_path!r}: {err}") from err
        return storage

    def _check_resources(self):
        """Fail at once, naming what is missing, when the cluster can never hold the minimum number of workers (a
        fixed cluster: no autoscaler); an autoscaling cluster may still grow, so the placement waits."""
        scaling = self.scaling_config
        low = scaling.worker_range[0]
        nodes = cluster_state.fixed_nodes()
        if nodes is None:
            return
        per_node = 1 if scaling.placement_strategy == "STRICT_SPREAD" else None
        cpus, gpus = scaling.num_cpus_per_worker, scaling.num_gpus_per_worker
        fit = recovery.workers_that_fit(nodes, cpus, gpus, low, per_node=per_node)
        if scaling.placement_strategy == "STRICT_PACK":
            fit = max((recovery.workers_that_fit([node], cpus, gpus, low) for node in nodes), default=0)
        if fit < low:
            raise ResourcesError(
                f"ScalingConfig(num_workers={scaling.num_workers!r}) needs {low} worker(s) of {cpus} CPU(s)"
                f"{f' and {gpus} GPU(s)' if gpus else ''} each ({scaling.placement_strategy}), but this Ray cluster "
                f"can hold {fit}: its nodes have {nodes} and it cannot grow (no autoscaler). Ask for fewer workers "
                f"or resources, or give num_workers a range (min, max)")

    def _group(self):
        scaling, torch_config = self.scaling_config, self.torch_config
        backend = torch_config.backend or ("nccl" if scaling.use_gpu else "gloo")
        return WorkerGroup({"use_gpu": scaling.use_gpu, "backend": backend},
                           num_cpus_per_worker=scaling.num_cpus_per_worker, num_gpus=scaling.num_gpus_per_worker,
                           timeout_s=torch_config.timeout_s, placement_strategy=scaling.placement_strategy,
                           worker_cls=FunctionWorker, num_spares=scaling.num_spares)

    def _limits(self):
        failure = self.run_config.failure_config
        return failure_policy.FailureLimits(
            max_failures=failure.max_failures, retry_user_errors=True,
            max_preemptions=getattr(failure, "max_preemption_failures", None))

    def _per_rank(self, group, feed=None):
        """Each rank's keyword arguments of ``run_loop`` for the group as it is now (a retry gets fresh ones): its
        node's worker count and rank, its Ray Data shards, with GPUs the node's GPUs, and rank 0 the progress bar's
        feed (``feed``)."""
        def per_rank(n):
            nodes = group.rank_nodes() or [None] * n
            order = list(dict.fromkeys(nodes))
            shards = {name: dataset.streaming_split(n, equal=True) for name, dataset in self.datasets.items()}
            gpus = dict(enumerate(group.run("gpu_ids", deadline_s=60))) if self.scaling_config.use_gpu else {}
            node_gpus: dict[Any, list] = {}
            for rank in range(n):
                if rank in gpus:
                    node_gpus.setdefault(gpus[rank][0], []).extend(gpus[rank][1])
            return [{"local_world_size": nodes.count(nodes[rank]), "node_rank": order.index(nodes[rank]),
                     "dataset_shards": {name: split[rank] for name, split in shards.items()},
                     **({"node_gpus": node_gpus.get(gpus[rank][0]), "own_gpus": gpus[rank][1]} if rank in gpus
                        else {}),
                     **({"progress": feed} if rank == 0 and feed is not None else {})} for rank in range(n)]

        return per_rank

    def fit(self) -> Result:
        """Run the training function on the workers until it returns; returns a :class:`~raysgd.train.result.Result`.
        Raises :class:`~raysgd.train.errors.WorkerGroupError` (a ``TrainingFailedError``, its ``result`` attached)
        when the function raised or the workers failed more often than ``FailureConfig`` allows."""
        storage = self._storage()
        if not ray.is_initialized():
            cluster_state.start_ray(None)  # as Ray Train does: a local cluster, or RAY_ADDRESS's
        self._check_resources()
        shipping.install()  # the training function and its config may go by value
        user, ours = split_callbacks(self.run_config.callbacks)
        callbacks = CallbackList(ours + [RayMetrics(run=self.run_config.name)])
        self._callbacks, self._user_callbacks, self._storage_folder = callbacks, UserCallbacks(user), storage
        self._callbacks_at: str | None = _START  # the checkpoint the callbacks' state is at (no report since), by name
        self._run_context = TrainRunContext(run_config=self.run_config, train_loop_config=self.train_loop_config,
                                            scaling_config=self.scaling_config, torch_config=self.torch_config)
        initial = (self.resume_from_checkpoint.uri, None) if self.resume_from_checkpoint is not None else None
        reports = ReportCommits(storage, home=this_node() if storage.local else None, initial=initial,
                                on_report=self._on_report, on_resume=self._resume_callbacks,
                                score_attribute=self.run_config.checkpoint_config.checkpoint_score_attribute,
                                checkpoint_config=self.run_config.checkpoint_config)
        if self.datasets and ray.cluster_resources().get("CPU", 0) <= \
                self.scaling_config.worker_range[1] * self.scaling_config.num_cpus_per_worker:
            logger.warning("TorchTrainer(datasets=...): the workers hold every CPU of the cluster, and Ray Data's "
                           "read tasks need CPUs of their own: reading will wait until some are free")
        low, high = self.scaling_config.worker_range
        group = self._group()
        self._controller = controller = RunController(
            group, operator_cls=self.train_loop_per_worker, initialization_hook=None,
            config=self.train_loop_config, split=lambda config, n, warn: (config, None), worker_range=(low, high),
            is_range=self.scaling_config.is_range, timeout_s=self.torch_config.timeout_s, commits=reports,
            durable=durable.NoStorage(), on_event=self._on_event, stateless=True)
        results, error = None, None
        started = time.monotonic()
        level = self.run_config.logging_config.log_level
        restore_level = logs.current_levels() if level is not None else None
        if level is not None:
            logs.set_log_level(level)
        bar = progress.ProgressBar() if self.run_config.progress_bar else None  # ValueError without tqdm
        feed = bar.start(local=False) if bar is not None else None

        def tick():
            reports.poll(controller.group)
            if bar is not None:
                bar.tick()

        try:
            controller.start()
            run_info = {"name": self.run_config.name, "storage_path": self.run_config.storage_path}
            results = controller.run_call("run_loop", None, {"run_info": run_info,
                                                             "rank_kwargs": self._per_rank(group, feed)},
                                          on_tick=tick, limits=self._limits())
        except Exception as err:  # noqa: BLE001 (a failed run ends with its Result and the cause)
            error = err
        finally:
            try:
                controller.shutdown(force=error is not None)
                controller.close()
                if bar is not None:
                    bar.finish(error is None)
                    bar.close()
            finally:
                callbacks.call("on_shutdown", self)
                self._controller = None
                if restore_level is not None:
                    logs.set_log_level(*restore_level)
        logger.debug("fit() %s after %.1f s: %d report(s), %d worker failure(s)",
                    "failed" if error is not None else "finished", time.monotonic() - started, reports.reports,
                    controller.num_failures)
        if error is None:
            return self._result(reports, results, None, controller.num_failures)
        failed = WorkerGroupError(self._failure_message(error, reports), worker_failures(error))
        failed.result = self._result(reports, results, failed, controller.num_failures)
        raise failed from error

    @staticmethod
    def _failure_message(error, reports):
        cause = _cause(error)
        kind = "the workers failed" if isinstance(cause, WorkerFailure) else "the training function raised"
        where = f"the latest checkpoint is {reports.latest[0]}" if reports.latest else "no checkpoint was reported"
        return f"{kind} ({type(cause).__name__}: {cause}); {where}"

    # ----------------------------------------------------------------- events
    def _on_report(self, record):
        """A report rank 0 made (polled while the function runs): callbacks hear its metrics as reported."""
        now = time.monotonic()
        if self._last_report_at is not None:
            self.last_call_s = now - self._last_report_at
        self._last_report_at = now
        metrics = record["metrics"][0]
        self._callbacks.call("on_train_result", self, metrics)
        checkpoint = Checkpoint(record["checkpoint"]) if record.get("checkpoint") else None
        if checkpoint is not None:
            self.last_commit_latency_s = self.last_checkpoint_s = record.get("seconds")
            logger.debug("Checkpoint %s reported", record["checkpoint"])
            self._callbacks.call("on_checkpoint", self, record["checkpoint"])
        self._user_callbacks.after_report(self._run_context, record["metrics"], checkpoint)
        self._callbacks_at = None
        if checkpoint is not None:
            self._keep_callbacks(record["checkpoint"])

    def _keep_callbacks(self, uri):
        """Keep the callbacks' state in the folder of the checkpoint ``uri`` just reported
        (:data:`~raysgd.torch.storage.filesystem.CALLBACKS_NOTE`): a run resuming from that checkpoint hands it back
        to them."""
        name = self._callbacks_at = _folder_name(uri)
        state = self._callbacks.state_dict()
        if state is None:
            return
        try:
            self._storage_folder.write_note(f"{name}/{filesystem.CALLBACKS_NOTE}", {"state": state})
        except Exception as err:  # noqa: BLE001 (the callbacks' state is a help; training goes on)
            logger.warning("Could not keep the callbacks' state with checkpoint %s: %s", uri, err)

    def _resume_callbacks(self, directory):
        """An attempt starts from the checkpoint in ``directory`` of the run folder (the run's first, or one after a
        failure): hand the callbacks the state they had when they heard it reported, before any report, so the
        reports made again after it are not logged twice (nothing to do when they heard none since). A checkpoint
        without one (its driver died before writing it, a moment after the checkpoint was complete) leaves them as
        they are, with a warning: a new driver's logger then starts a new run of its tracker. ``directory`` None:
        an attempt after a failure starts from the beginning (no checkpoint of the run folder yet): the callbacks
        that heard a report since are rewound (:meth:`~raysgd.callbacks.Callback.rewind`)."""
        if directory is None:  # a restart from the beginning: no checkpoint of the run folder to resume from
            if self._callbacks_at != _START:
                self._callbacks.rewind()
                self._callbacks_at = _START
            return
        name = _folder_name(directory)
        if self._callbacks_at == name:
            return
        note = self._storage_folder.read_note(f"{name}/{filesystem.CALLBACKS_NOTE}")
        if note is not None:
            self._callbacks.load_state_dict(note.get("state"))
            self._callbacks_at = name
        elif any(type(callback).state_dict is not Callback.state_dict for callback in self._callbacks.callbacks):
            logger.warning("Checkpoint %s keeps no state of the callbacks (its driver stopped before writing it): "
                           "they go on as they are", name)

    def _on_event(self, kind, *args):
        """The controller's events, as callback hooks: ``failure`` -> ``on_failure`` (and the user callbacks'
        ``after_exception``), ``resize`` -> ``on_resize``."""
        hook = {"failure": "on_failure", "resize": "on_resize"}.get(kind)  # "state": the run's moves, logged
        if hook is not None:
            self._callbacks.call(hook, self, *args)
        if kind == "failure":
            self._user_callbacks.after_exception(self._run_context, worker_failures(args[0].error))

    # ----------------------------------------------------------------- the result
    def _result(self, reports, results, error, failures):
        kept = [(Checkpoint(uri), marker.get("metrics", {})) for uri, marker in complete_checkpoints(reports.storage)]
        metrics = reports.last_report["metrics"][0] if reports.last_report is not None else None
        value = (results[0] or {}).get("return_value") if results else None
        return Result.from_checkpoints(kept, path=reports.storage.path, checkpoint_config=self.run_config.checkpoint_config,
                                       metrics=metrics, error=error, return_value=value, num_failures=failures,
                                       storage_filesystem=reports.storage.filesystem)


def _folder_name(path):
    """The name of a checkpoint's folder in the run folder, from its path or URI (a URI's query options dropped).

    Example:
        >>> _folder_name("s3://bucket/run/checkpoint_000002?region=x"), _folder_name("/tmp/run/best/")
        ('checkpoint_000002', 'best')
    """
    return path.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1]


def _cause(error):
    """The failure behind the controller's "gave up" error (its cause), else ``error`` itself."""
    return error.__cause__ if isinstance(error, RuntimeError) and isinstance(error.__cause__, WorkerFailure) else error


def worker_failures(error: BaseException) -> dict[int, BaseException]:
    """``{world rank: exception}`` of a failure (Ray Train's ``WorkerGroupError.worker_failures``): a worker failure's
    ranks, each with what happened to it, or the rank whose training function raised ``error``.

    Example:
        >>> worker_failures(WorkerFailure("ended", {1: "worker process died"}))
        {1: RuntimeError('worker process died')}
        >>> worker_failures(ValueError("bad"))
        {0: ValueError('bad')}
    """
    cause = _cause(error)
    if isinstance(cause, WorkerFailure):
        return {int(rank): RuntimeError(str(text)) for rank, text in (cause.causes or {}).items()}
    rank = rank_of(cause)
    return {rank if rank is not None else 0: cause}
