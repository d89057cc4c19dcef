"""TorchTrainer: the driver-side API, a thin facade that checks its options and hands every call to the controller.

Layer 7 (the top of the core): imports layers 0-6. The options, their defaults and checks are
:class:`~raysgd.torch.options.TrainerOptions`; the run itself (the worker group, the restart point, failures,
resizes, commits, the durable run) belongs to :class:`~raysgd.torch.execution.controller.RunController`; the
integrations (the progress bar, result logs, Ray Data input, Tune) are wired in here and nowhere below. The
trainer holds no run state of its own.

Example:
    >>> import ray
    >>> from raysgd import TorchTrainer
    >>> from raysgd.torch.examples.train_example import get_linear_operator  # doctest: +SKIP
    >>> trainer = TorchTrainer(training_operator_cls=get_linear_operator(), num_workers=2)  # doctest: +SKIP
    >>> for epoch in range(3):  # doctest: +SKIP
    ...     print(trainer.train()["train_loss"], trainer.validate()["val_loss"])
    >>> model = trainer.get_model()  # doctest: +SKIP
    >>> trainer.shutdown()  # doctest: +SKIP
"""
from __future__ import annotations

import logging
import os
import time

import ray

from raysgd.base.checks import MAX_TIMEOUT_S, expect, is_number
from raysgd.callbacks import CallbackList
from raysgd.meters import reduce_worker_stats
from raysgd.torch.execution import cluster_state, shipping
from raysgd.torch.execution.controller import RunController
from raysgd.torch.execution.worker_group import WorkerGroup
from raysgd.torch.integrations import progress, ray_data, results
from raysgd.torch.integrations.ray_metrics import RayMetrics
from raysgd.torch.operator import tracing
from raysgd.torch.options import TrainerOptions, check_checkpoint_path, check_hook, check_info, check_num_steps
from raysgd.torch.sharding import batch_split
from raysgd.torch.state import checkpoint
from raysgd.torch.commits.commit_policy import CommitPolicy
from raysgd.torch.storage import durable
from typing import TYPE_CHECKING, Any, Callable, Mapping, cast

if TYPE_CHECKING:
    from raysgd.torch.integrations.progress import ProgressBar
    from raysgd.torch.training_operator import TrainingOperator

logger = logging.getLogger(__name__)


class TorchTrainer:
    """Trains a :class:`~raysgd.TrainingOperator` on ``num_workers`` data-parallel Ray actors.

    Every argument is keyword-only and checked before any actor starts (:class:`~raysgd.torch.options.TrainerOptions`
    holds each one's default, check and doc line; the docs' options table is made from it); the defaults follow RaySGD
    1.12. ``use_tqdm=True`` shows one progress bar on the driver's stderr, fed by rank 0; ``logdir`` (a path or a
    :class:`~raysgd.torch.integrations.results.ResultLogger`) appends every ``train()``/``validate()`` result to CSV
    files and TensorBoard there. ``storage_path``: see Durable runs. ``controller`` is the run's
    :class:`~raysgd.torch.execution.controller.RunController` (its ``durable`` run, ``commits`` policy, ``group``).

    Example:
        >>> trainer = TorchTrainer(training_operator_cls=MyOperator, num_workers=2,  # doctest: +SKIP
        ...                        config={"lr": 1e-2, BATCH_SIZE: 64})
        >>> stats = trainer.train()  # doctest: +SKIP
    """

    if TYPE_CHECKING:  # every TrainerOptions field is an attribute (set in __init__ from options.attributes())
        def __getattr__(self, name: str) -> Any: ...

    def __init__(self, **kwargs):  # its signature: TrainerOptions.signature() (set below)
        options = TrainerOptions.from_kwargs(kwargs)  # every check, before anything starts
        for name, value in options.attributes().items():
            setattr(self, name, value)
        self.min_replicas, self.max_replicas = options.worker_range()
        self._options = options
        self._progress = progress.ProgressBar() if options.use_tqdm else None  # ValueError without tqdm, as 1.12
        self._results = results.open_result_log(options.logdir)
        self._callbacks = CallbackList(([results.ResultLogCallback(self._results)] if self._results else [])
                                       + options.callbacks)  # the result log first, then the user's, in order
        run = durable.open_run(options.storage_path, options.num_to_keep, options.resume,  # checked
                               on_written=self._on_checkpoint)
        self._shards = ray_data.ShardCache()
        self._controller = cast("RunController", None)  # None until RunController(...) below returns
        self._last_call_s = self._last_checkpoint_s = None
        shipping.install()  # before any class is shipped: see raysgd.torch.execution.shipping
        if not ray.is_initialized():
            cluster_state.start_ray(os.environ.get("RAY_ADDRESS") or "local")
        if options.ray_metrics:
            self._callbacks.add(RayMetrics())  # after Ray starts: its metrics need a connected driver
        commits = CommitPolicy(options.commit_every_n_steps)
        try:
            if options.use_gpu and ray.cluster_resources().get("GPU", 0) < min(1, options.num_gpus_per_worker):
                raise ValueError(f"TorchTrainer(use_gpu=True) needs GPUs, but the Ray cluster has none: "
                                 f"{ray.cluster_resources()}")
            group = WorkerGroup(options.worker_options(), num_cpus_per_worker=options.num_cpus_per_worker,
                                num_gpus=options.num_gpus_per_worker if options.use_gpu else 0,
                                use_local=options.use_local, timeout_s=options.timeout_s,
                                placement_strategy=options.placement_strategy, num_spares=options.num_spares)
            self._controller = RunController(
                group, operator_cls=options.training_operator_cls, initialization_hook=options.initialization_hook,
                config=options.config, split=batch_split.splitter(options.fixed_worker_batch, self.max_replicas),
                worker_range=(self.min_replicas, self.max_replicas), is_range=isinstance(options.num_workers, tuple),
                timeout_s=options.timeout_s, commits=commits, durable=run, on_event=self._on_event,
                components=self._components())
            self._controller.start()
        except BaseException:
            if self._controller is None:  # what the controller would have closed
                self._close_parts(run, commits)
            self._close_quietly()  # the workers, and the threads of the result log and the durable run
            raise
        commits.prepare()  # the store's process starts now, not when a failure needs it

    # ----------------------------------------------------------------- the run
    @property
    def controller(self) -> RunController:
        """The run's :class:`~raysgd.torch.execution.controller.RunController`."""
        return self._controller

    @property
    def initialization_hook(self) -> Callable[[], Any] | None:
        """The function every worker runs before its process group is set up; setting it changes what the workers
        started later (a restart, a resize) run."""
        return self._controller.initialization_hook

    @initialization_hook.setter
    def initialization_hook(self, hook: Callable[[], Any] | None) -> None:
        self._controller.initialization_hook = check_hook(hook)

    @property
    def worker_group(self) -> WorkerGroup:
        """The :class:`~raysgd.torch.execution.worker_group.WorkerGroup` (``num_workers``, ``remote_workers``...)."""
        return self._controller.group

    @property
    def last_call_s(self) -> float | None:
        """How many seconds the last ``train()``/``validate()`` call took (None before any)."""
        return self._last_call_s

    @property
    def last_commit_latency_s(self) -> float | None:
        """Seconds the latest commit inside a ``train()`` call took until the store held every rank's record (the
        slowest rank's), of the last call that stored one; None before any."""
        controller = self.__dict__.get("_controller")
        return controller.last_commit_latency_s if controller is not None else None

    @property
    def holder_replacements(self) -> int:
        """How many commit part holders (one per node, keeping the committed state parts) lost their process and were
        replaced on their node so far (Ray restarts them; the next commit is kept by the new one)."""
        controller = self.__dict__.get("_controller")
        return controller.commits.holder_replacements if controller is not None else 0

    @property
    def last_checkpoint_s(self) -> float | None:
        """Seconds the latest durable checkpoint (``storage_path``) took to write, state and marker; None before any.
        Set on the checkpoint writer's thread just before ``on_checkpoint`` is called."""
        return self._last_checkpoint_s

    @property
    def callbacks(self) -> CallbackList:
        """The :class:`~raysgd.callbacks.CallbackList` the trainer calls (``logdir``'s result log first)."""
        return self._callbacks

    def _components(self):
        """The driver-side :class:`~raysgd.base.stateful.Stateful` components every durable checkpoint keeps, by their
        keys in its marker (the names earlier versions wrote): the result log, rewound first on resume, then the
        callbacks."""
        components = {"result_rows": self._results} if self._results is not None else {}
        return {**components, "callback_state": self._callbacks}

    def _on_event(self, kind, *args):
        """The controller's events, as callback hooks: ``failure`` -> ``on_failure``, ``resize`` -> ``on_resize``."""
        hook = {"failure": "on_failure", "resize": "on_resize"}.get(kind)  # "state": the run's moves, logged
        if hook is not None:
            self._callbacks.call(hook, self, *args)

    def _on_checkpoint(self, path, seconds):
        self._last_checkpoint_s = seconds
        self._callbacks.call("on_checkpoint", self, path)

    @property
    def progress_bar(self) -> ProgressBar | None:
        """The driver's :class:`~raysgd.torch.integrations.progress.ProgressBar` with ``use_tqdm=True`` (its
        ``last_state`` is what the bar showed last), else None."""
        return self._progress

    @property
    def config(self) -> Mapping[str, Any]:
        """The trainer config, read-only, with ``BATCH_SIZE`` as it is divided among the current workers."""
        return self._controller.config

    @property
    def num_failures(self) -> int:
        """How many worker failures ``train()`` has recovered from (or met) so far."""
        return self._controller.num_failures

    @property
    def num_spares_ready(self) -> int:
        """How many warm spares (``num_spares``) are ready now, checked without waiting. A ready spare takes a lost
        worker's rank in well under a second; until the spares are ready (their first seconds, and again for a
        moment after one took a rank) a lost rank waits for a new process, which takes seconds. The log says
        once when they are ready.

        Example:
            >>> trainer = TorchTrainer(training_operator_cls=MyOperator, num_workers=2, num_spares=1)  # doctest: +SKIP
            >>> while trainer.num_spares_ready < 1:  # doctest: +SKIP
            ...     time.sleep(0.1)  # e.g. before a run that must recover fast from its first step
            >>> stats = trainer.train()  # doctest: +SKIP
        """
        return self.worker_group.spares.available()

    # ----------------------------------------------------------------- train / validate
    def train(self, num_steps: int | None = None, profile: bool = False, reduce_results: bool = True,
              max_retries: int = 3, info: dict | None = None, dataset: Any = None) -> Any:
        """Train one epoch (or ``num_steps`` batches per worker) on every worker; returns the metrics.

        A worker that dies or stops answering ends the attempt; the call goes on from its latest commit
        (or its start) on as many workers as fit, at most ``max_retries`` times. When more workers fit
        meanwhile, the call grows at a commit point (see :mod:`raysgd.torch.execution.controller`).
        ``dataset`` (a ``ray.data.Dataset`` or :class:`~raysgd.torch.integrations.ray_data.DatasetInput`) replaces
        the registered train loader for this call: each worker reads its own streaming-split shard.

        Example:
            >>> stats = trainer.train(profile=True)  # doctest: +SKIP
            >>> stats["train_loss"], stats["num_samples"], stats["profile"]["mean_fwd_s"]  # doctest: +SKIP
        """
        num_steps = check_num_steps(num_steps)  # before any work: None, or an int >= 0 (0: no batch)
        info = check_info(info)
        RunController.check_max_retries(max_retries)  # before the dataset is split and the bar starts
        data = ray_data.as_input(dataset, self.training_operator_cls, num_steps) if dataset is not None else None
        reporter = self._progress.start(local=self.use_local) if self._progress is not None else None
        completed, started = False, time.monotonic()
        try:
            rank_kwargs = ray_data.rank_inputs(data, reporter, self._shards, self.worker_group,
                                               dict(self._options.config or {}), self.timeout_s,
                                               self.num_cpus_per_worker)
            call = dict(num_steps=num_steps, profile=profile, info=info, lockstep=True,
                        rank_kwargs=rank_kwargs)
            on_tick = cast("ProgressBar", self._progress).tick if reporter is not None else None  # from the bar
            stats = self._controller.run_call("train_epoch", max_retries, call, replay=data is not None,
                                              on_tick=on_tick)
            completed = True
        finally:
            if reporter is not None:
                cast("ProgressBar", self._progress).finish(completed)  # a reporter comes from the bar
            if data is not None and (not completed or num_steps is not None):
                self._shards.drop()  # the split is mid-pass (stuck, or stopped by num_steps): split afresh next time
        self._last_call_s = time.monotonic() - started
        return self._log_result("train", stats, reduce_results)

    def _log_result(self, phase, stats, reduce_results):
        """Reduce the per-worker stats, log them (``logdir``), checkpoint (``storage_path``), return what was asked."""
        reduced = reduce_worker_stats(stats)
        self._callbacks.call(f"on_{phase}_result", self, reduced)  # the result log, then the user's callbacks
        self._controller.on_result(phase, reduced)
        return reduced if reduce_results else stats

    def profile(self, num_steps: int | None, logdir: str | os.PathLike, max_retries: int = 3,
                info: dict | None = None) -> dict:
        """Train ``num_steps`` batches per worker (as ``train(num_steps=...)``) under ``torch.profiler`` on every
        rank, and write one Chrome trace per rank to ``logdir`` (``rank_<r>.pt.trace.json``: Perfetto,
        ``chrome://tracing`` and TensorBoard's PyTorch profiler plugin open them). Returns ``train()``'s reduced
        result with ``"traces"``: the paths written. The steps count as training (the data cursor, commits,
        ``logdir``/``storage_path`` results as for ``train()``); a rank replaced during the call has no trace.
        ``train(profile=True)`` keeps its 1.x meaning (timings of the call's parts).

        Example:
            >>> result = trainer.profile(num_steps=5, logdir="traces")  # doctest: +SKIP
            >>> result["traces"]  # doctest: +SKIP
            ['traces/rank_0.pt.trace.json', 'traces/rank_1.pt.trace.json']
        """
        num_steps = check_num_steps(num_steps)
        expect(num_steps is not None and num_steps >= 1, "num_steps", "an int >= 1 (batches per worker to profile)",
               num_steps, caller="profile")
        info = check_info(info, "profile")
        RunController.check_max_retries(max_retries)  # before the logdir is made
        folder, started = tracing.prepare_logdir(logdir), time.monotonic()
        stats = self._controller.run_call("train_epoch", max_retries, dict(
            num_steps=num_steps, profile=False, info=info, lockstep=True, trace=True))
        self._last_call_s = time.monotonic() - started
        paths = tracing.write_traces(self._controller.take_traces(), folder)
        logger.info("profile: %d trace(s) written to %s", len(paths), folder)
        return dict(self._log_result("train", stats, True), traces=paths)

    def validate(self, num_steps: int | None = None, profile: bool = False, reduce_results: bool = True,
                 info: dict | None = None, max_retries: int = 3) -> Any:
        """Validate on every worker's shard of the validation set; returns the metrics.

        Example:
            >>> trainer.validate()["val_loss"]  # doctest: +SKIP
        """
        num_steps = check_num_steps(num_steps)
        info = check_info(info, "validate")
        started = time.monotonic()
        stats = self._controller.run_call("validate", max_retries, dict(num_steps=num_steps, profile=profile,
                                                                          info=info, lockstep=True))
        self._last_call_s = time.monotonic() - started
        return self._log_result("validate", stats, reduce_results)

    # ----------------------------------------------------------------- operators and models
    def apply_all_workers(self, fn: Callable[[], Any]) -> list:
        """Call ``fn()`` on every worker; returns the results in rank order."""
        expect(callable(fn), "fn", "a function taking no arguments", fn, TypeError, caller="apply_all_workers",
               got=type(fn).__name__)  # before it is sent (each worker raised)
        shipping.install()  # fn may be sent by value (see raysgd.torch.execution.shipping)
        return self._controller.run("apply", fn)

    def apply_all_operators(self, fn: Callable[[Any], Any]) -> list:
        """Call ``fn(operator)`` on every worker's operator; returns the results in rank order."""
        expect(callable(fn), "fn", "a function taking the operator", fn, TypeError, caller="apply_all_operators",
               got=type(fn).__name__)
        shipping.install()
        return self._controller.run("apply_operator", fn)

    def update_scheduler(self, metric: Any) -> None:
        """Call ``scheduler.step(metric)`` on every worker (for ``scheduler_step_freq="manual"``)."""
        self._controller.run("update_scheduler", metric)

    def get_model(self, to_cpu: bool = False) -> Any:
        """The trained model(s) of rank 0, unwrapped (no DDP): one model, or a list for several.

        With ``to_cpu=True`` they are CPU copies; the workers' own models never move. Under ``strategy="fsdp"`` every
        rank takes part in gathering the whole models, returned on CPU as plain modules of their own classes.
        """
        models = self._controller.full_models() if self.strategy == "fsdp" else self._controller.models(to_cpu)
        return models[0] if len(models) == 1 else models

    def stack_traces(self, timeout_s: float | None = 5.0) -> dict:
        """``{rank: text}``: where every rank is now (its Python stacks); callable from another thread.

        Example:
            >>> threading.Thread(target=trainer.train).start()  # doctest: +SKIP
            >>> print(trainer.stack_traces()[1])  # doctest: +SKIP
        """
        expect(timeout_s is None or is_number(timeout_s, minimum=0, maximum=MAX_TIMEOUT_S), "timeout_s",
               "a number of seconds >= 0, or None (wait for every rank)", timeout_s,
               caller="stack_traces")  # a hung run's diagnosis must not fail inside Ray's wait
        return self.worker_group.stack_traces(timeout_s)

    def get_local_operator(self) -> TrainingOperator:
        """The rank-0 operator living in this process (needs ``use_local=True``)."""
        operator = self._controller.local_operator()
        if operator is None:
            raise NotImplementedError("get_local_operator() needs TorchTrainer(use_local=True).")
        return operator

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict:
        """Rank 0's state: ``{epoch, global_step, operator, models, optimizers[, schedulers][, amp_*]}`` on CPU."""
        return self._controller.state_dict()

    def latest_commit(self) -> dict | None:
        """The latest complete commit of the running (or last) ``train()`` call as a state dict, or None.

        Its ``cursor`` and per-rank ``rng`` let :meth:`load_state_dict` resume that epoch exactly there. Commits
        are sent in the background: one taken at the call's last step may complete just after ``train()`` returned.
        Example: ``trainer.latest_commit()["cursor"]["consumed"]``; safe from another thread during train().
        """
        return self._controller.latest_commit()

    def load_state_dict(self, state_dict: dict | bytes, blocking: bool = False, weights_only: bool = True) -> None:
        """Load ``state_dict`` (or its ``torch.save`` bytes) on every worker (each onto its own device).

        Bytes are loaded safely (``weights_only=True``, as :meth:`load`): checked in the driver, then on every
        worker; pass ``weights_only=False`` only for bytes you trust whose state needs other objects. A dict or
        bytes that are not a trainer state raise :class:`~raysgd.torch.errors.CheckpointError` before anything
        is sent. The call returns before the workers finish unless ``blocking``; later calls run after it.

        Example:
            >>> trainer.load_state_dict(other.state_dict(), blocking=True)  # doctest: +SKIP
        """
        stream, weights_only = checkpoint.checked_stream(state_dict, weights_only)  # (bytes, how to load them)
        self._controller.load_stream(stream, weights_only, blocking=blocking)

    def save(self, checkpoint_path: str | os.PathLike, consolidated: bool = False) -> str:
        """Write the trainer state to ``checkpoint_path`` atomically (and to ``storage_path``); returns the path.

        Under ``strategy="fsdp"`` the path becomes a checkpoint directory (a DCP folder: one part per rank, written
        on the workers' nodes), which :meth:`load` reads at any number of workers; ``consolidated=True`` writes one
        file of whole tensors instead (gathered here: for serving, or another tool).

        Example:
            >>> trainer.save("ckpt")  # doctest: +SKIP
        """
        check_checkpoint_path(checkpoint_path, "save")  # before the workers' state is gathered
        return self._controller.save(checkpoint_path, consolidated=consolidated)

    def load(self, checkpoint_path: str | os.PathLike, weights_only: bool = True, blocking: bool = False) -> None:
        """Load a file written by :meth:`save` (``weights_only=False`` only for trusted files; see
        docs/trainer.md), or a checkpoint directory of ``storage_path`` or Tune (a local path or a URI such as ``s3://bucket/run/...``).
        Anything else (a text file, another pickle, a model's weights) raises
        :class:`~raysgd.torch.errors.CheckpointError` naming it, before anything is sent to the workers."""
        check_checkpoint_path(checkpoint_path, "load")
        self._controller.load_path(checkpoint_path, weights_only=weights_only, blocking=blocking)

    def restore(self, *args: Any) -> None:
        """Removed in 1.x: always raises ``DeprecationWarning`` pointing at :meth:`load`."""
        raise DeprecationWarning("TorchTrainer.restore() is deprecated: use TorchTrainer.load(checkpoint).")

    def shutdown(self, force: bool = False) -> None:
        """Stop the workers and release their resources; the trainer cannot be used afterwards. Waits for the last
        ``storage_path`` upload (at most ``SGD_CHECKPOINT_FLUSH_S``) and then raises its failure, if any."""
        controller = self.__dict__.get("_controller")
        try:
            if controller is not None:
                controller.shutdown(force=force)  # returns once Ray shows the resources free (bounded)
        finally:
            try:
                for name in ("_progress", "_results", "_shards"):  # the bar, the logs, the Ray Data splits
                    part = self.__dict__.get(name)
                    try:
                        if part is not None:
                            part.close()
                    except Exception as err:  # noqa: BLE001 (close the others anyway)
                        logger.warning("Closing %s at shutdown failed: %s", name, err)
                if controller is not None:
                    controller.close()  # the uploads, then the commit store; raises an upload's failure
            finally:
                callbacks, self._callbacks = self.__dict__.get("_callbacks"), CallbackList()  # once only
                if callbacks is not None:
                    callbacks.call("on_shutdown", self)  # after the last checkpoint is written

    def _close_parts(self, run, commits):
        for name, part in (("_durable", run), ("_commits", commits)):
            try:
                part.close()
            except Exception as err:  # noqa: BLE001 (the start's error is the one to raise)
                logger.warning("Closing %s after a failed start: %s", name, err)

    def _close_quietly(self):
        try:  # after a failed start: the start's error is the one to raise
            self.shutdown(force=True)
        except Exception as err:  # noqa: BLE001
            logger.warning("Closing the trainer after a failed start: %s", err)

    @classmethod
    def as_trainable(cls, *args: Any, override_tune_step: Callable | None = None, **kwargs: Any) -> type:
        """A Ray Tune ``Trainable`` class training with ``TorchTrainer(**kwargs)`` (see
        :mod:`raysgd.torch.integrations.tune`)."""
        from raysgd.torch.integrations.tune import make_trainable  # noqa: PLC0415 (Tune stays optional)

        return make_trainable(cls, *args, override_tune_step=override_tune_step, **kwargs)


TorchTrainer.__init__.__signature__ = TrainerOptions.signature()  # type: ignore[attr-defined]  # help() and inspect show every keyword option


def __getattr__(name):
    """``BaseTorchTrainable``, where 1.x defined it; :mod:`raysgd.torch.integrations.tune` imports Ray Tune, so on
    first use."""
    if name == "BaseTorchTrainable":
        from raysgd.torch.integrations.tune import BaseTorchTrainable  # noqa: PLC0415 (Tune stays optional until used)

        return BaseTorchTrainable
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
