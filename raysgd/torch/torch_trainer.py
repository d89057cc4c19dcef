"""TorchTrainer: the driver-side API. Runs train/validate through the recovery loop and reduces metrics.

Layer 5: imports layers 0-4. Argument checks live in :mod:`raysgd.torch.arguments`, the worker pool
in :mod:`raysgd.torch.worker_group`, the retry policy in :mod:`raysgd.torch.fault_tolerance.recovery`, a call's
attempts (retries, resuming from commits, growing) in :mod:`raysgd.torch.attempts`.

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
import logging
import os
import time
import types

import ray

from raysgd.torch import arguments, attempts, constants, elastic, shipping
from raysgd.torch.integrations import progress
from raysgd.torch.integrations import ray_data
from raysgd.torch.integrations import results
from raysgd.torch.operator import accumulation
from raysgd.torch.state import checkpoint
from raysgd.torch.state import commit_policy as commits
from raysgd.torch.storage import durable
from raysgd.torch.storage import filesystem as storage
from raysgd.torch.errors import WorkerFailure
from raysgd.torch.sharding import batch_split
from raysgd.torch.worker_group import WorkerGroup
from raysgd.meters import reduce_worker_stats
from raysgd.torch.constants import BATCH_SIZE

logger = logging.getLogger(__name__)


class _ShutDownGroup:
    """Stands in for the worker group after ``shutdown()``: any use says the trainer is gone."""

    def __getattr__(self, name):
        raise RuntimeError("This TorchTrainer was shut down and its workers are gone: create a new TorchTrainer.")


class TorchTrainer:
    """Trains a :class:`~raysgd.TrainingOperator` on ``num_workers`` data-parallel Ray actors.

    Every argument is keyword-only and checked before any actor starts. See the README for each one;
    the defaults follow RaySGD 1.12. ``use_tqdm=True`` shows one progress bar on the driver's stderr,
    fed by rank 0; ``logdir`` (a path or a :class:`~raysgd.torch.integrations.results.ResultLogger`) appends every
    ``train()``/``validate()`` result to CSV files and TensorBoard there. ``storage_path``: see Durable runs.

    Example:
        >>> trainer = TorchTrainer(training_operator_cls=MyOperator, num_workers=2,  # doctest: +SKIP
        ...                        config={"lr": 1e-2, BATCH_SIZE: 64})
        >>> stats = trainer.train()  # doctest: +SKIP
    """

    def __init__(self, *, training_operator_cls=None, initialization_hook=None, config=None, num_workers=1,
                 num_cpus_per_worker=1, use_gpu="auto", backend="auto", wrap_ddp=True, timeout_s=1800,
                 use_fp16=False, use_tqdm=False, add_dist_sampler=True, scheduler_step_freq=None,
                 use_local=False, logdir=None, placement_strategy="SPREAD", commit_every_n_steps=None,
                 storage_path=None, num_to_keep=2, resume=True, fixed_worker_batch=False, num_gpus_per_worker=1,
                 **deprecated):
        arguments.check_deprecated(deprecated)
        use_gpu, backend = arguments.check_arguments(
            training_operator_cls=training_operator_cls, initialization_hook=initialization_hook, config=config,
            num_workers=num_workers, num_cpus_per_worker=num_cpus_per_worker, use_gpu=use_gpu, backend=backend,
            wrap_ddp=wrap_ddp, timeout_s=timeout_s, use_fp16=use_fp16, use_tqdm=use_tqdm,
            add_dist_sampler=add_dist_sampler, scheduler_step_freq=scheduler_step_freq, use_local=use_local,
            placement_strategy=placement_strategy, num_gpus_per_worker=num_gpus_per_worker)
        self.training_operator_cls = training_operator_cls
        self.initialization_hook = initialization_hook
        self._requested_config = dict(config or {})
        self.min_replicas, self.max_replicas = arguments.worker_range(num_workers)
        self._fixed_worker_batch = accumulation.check(fixed_worker_batch, config, self.max_replicas, use_fp16)
        # BATCH_SIZE against the largest size (a smaller one gives every worker more); warns if it is uneven
        batch_split.split_batch_size(self._requested_config, self.max_replicas)
        self._split_warned = {self.max_replicas}  # sizes whose uneven split was reported: once per size
        self._config = dict(self._requested_config)
        self.num_cpus_per_worker, self.num_gpus_per_worker = num_cpus_per_worker, num_gpus_per_worker
        self.use_gpu = use_gpu
        self.backend = backend
        self.timeout_s = timeout_s
        self.use_fp16 = use_fp16
        self.use_tqdm = use_tqdm
        self.use_local = use_local
        self.scheduler_step_freq = scheduler_step_freq
        self._worker_options = dict(use_gpu=use_gpu, use_fp16=use_fp16, use_tqdm=use_tqdm, wrap_ddp=wrap_ddp,
                                    add_dist_sampler=add_dist_sampler, scheduler_step_freq=scheduler_step_freq,
                                    backend=backend)
        self._num_failures = 0
        self._last_resize = float("-inf")
        self._snapshot = None  # rank 0's state bytes: the restart point (kept until a fresher one is taken)
        self._snapshot_stale = True  # the state may have moved on since the snapshot
        self._commits = commits.CommitPolicy(commit_every_n_steps)
        self._resize_cooldown_s = constants.env_float("SGD_RESIZE_COOLDOWN_S", constants.RESIZE_COOLDOWN_S)
        self._progress = progress.ProgressBar() if use_tqdm else None  # ValueError without tqdm, as 1.12
        self._results = results.open_result_log(logdir)
        self._durable = durable.open_run(storage_path, num_to_keep, resume, self._results)  # checked before Ray
        self._shards = ray_data.ShardCache()
        shipping.install()  # before any class is shipped: see raysgd.torch.shipping
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS", "local")
            logger.info("Ray is not initialized: starting it (address=%r)", address)
            ray.init(address=address)
        try:
            if use_gpu and ray.cluster_resources().get("GPU", 0) < min(1, num_gpus_per_worker):
                raise ValueError(f"TorchTrainer(use_gpu=True) needs GPUs, but the Ray cluster has none: "
                                 f"{ray.cluster_resources()}")
            self.worker_group = WorkerGroup(self._worker_options, num_cpus_per_worker=num_cpus_per_worker,
                                            num_gpus=num_gpus_per_worker if use_gpu else 0, use_local=use_local,
                                            timeout_s=timeout_s, placement_strategy=placement_strategy)
            elastic.start_first_group(self._start_workers, self.worker_group.how_many_fit, self.min_replicas,
                                      self.max_replicas, isinstance(num_workers, tuple),
                                      constants.SGD_PLACEMENT_GROUP_TIMEOUT_S)
            self._durable.resume(self._load_stream, timeout_s)  # storage_path's newest checkpoint (checked, safe)
        except BaseException as err:
            self._close_quietly()  # the workers, and the threads of the result log and the durable run
            if isinstance(err, WorkerFailure):
                raise RuntimeError("Worker startup failed: a worker died while starting (see the cause).") from err
            raise
        self._commits.prepare()  # the store's process starts now, not when a failure needs it

    # ----------------------------------------------------------------- workers
    @property
    def config(self):
        """The trainer config, read-only, with ``BATCH_SIZE`` as it is divided among the current workers."""
        return types.MappingProxyType(self._config)

    @property
    def num_failures(self):
        """How many worker failures ``train()`` has recovered from (or met) so far."""
        return self._num_failures

    def _worker_config(self, num_workers):
        """The config each of ``num_workers`` workers gets (the batch size divided among them)."""
        split = batch_split.splitter(self._fixed_worker_batch, self.max_replicas)
        worker_config, effective = split(self._requested_config, num_workers,
                                         warn=num_workers not in self._split_warned)
        self._split_warned.add(num_workers)
        self._config = dict(self._requested_config)
        if effective is not None:
            self._config[BATCH_SIZE] = effective
        return worker_config

    def _start_workers(self, num_workers, pg_timeout_s=None):
        """Start ``num_workers`` workers with the batch size divided among them; returns the count."""
        return self.worker_group.start(num_workers, self.training_operator_cls, self._worker_config(num_workers),
                                       pg_timeout_s, initialization_hook=self.initialization_hook)

    def _resize_worker_group(self, state, max_retries=None, target=None):
        """Restart the group loading ``state`` (see :func:`raysgd.torch.elastic.restart_group`); returns its size."""
        started = elastic.restart_group(self, state, max_retries=max_retries, target=target)
        self._last_resize = time.monotonic()
        return started

    def _ensure_workers(self):
        """Restart a group torn down by a failure (from the last snapshot) before using it."""
        group = self.worker_group  # raises after shutdown()
        if group.broken or group.num_workers == 0:
            if self._snapshot is None:
                raise RuntimeError("The workers were lost and no state snapshot exists to restart them from.")
            self._resize_worker_group(self._snapshot)

    def _first_answer(self, method, *args):
        """``first_answer`` of the group; when every worker was lost between calls, they restart from the last
        restart point (what they trained since is lost: logged, counted as a failure) and are asked again."""
        try:
            return self.worker_group.first_answer(method, *args, deadline_s=self.timeout_s)
        except WorkerFailure as failure:
            if not self.worker_group.broken or self._snapshot is None:
                raise
            self._num_failures += 1
            logger.warning("Every worker was lost between calls (%s); restarting them from the state at the start "
                           "of the last call: what they trained since is lost", failure)
            self._ensure_workers()
            return self.worker_group.first_answer(method, *args, deadline_s=self.timeout_s)

    def _take_snapshot(self):
        """Rank 0's current state bytes (any live rank's if rank 0 is gone: DDP replicas hold the same state), with
        every rank's random streams, so a retry from it puts each rank's streams back (dropout draws the same)."""
        if self._snapshot is None or self._snapshot_stale:
            rngs = self.worker_group.answers("rng_state", deadline_s=self.timeout_s) \
                if self.worker_group.num_workers > 1 else None
            self._snapshot = self._first_answer("state_stream", rngs)
            self._snapshot_stale = False
        return self._snapshot

    def _maybe_scale_up(self, state):
        target = elastic.scale_up_target(self.worker_group, self.max_replicas, self._last_resize,
                                         self._resize_cooldown_s)
        if target is not None:
            self._resize_worker_group(state, target=target)

    # ----------------------------------------------------------------- train / validate
    def train(self, num_steps=None, profile=False, reduce_results=True, max_retries=3, info=None, dataset=None):
        """Train one epoch (or ``num_steps`` batches per worker) on every worker; returns the metrics.

        A worker that dies or stops answering ends the attempt; the call goes on from its latest commit
        (or its start) on as many workers as fit, at most ``max_retries`` times. When more workers fit
        meanwhile, the call grows at a commit point (see :mod:`raysgd.torch.attempts`).
        ``dataset`` (a ``ray.data.Dataset`` or :class:`~raysgd.torch.integrations.ray_data.DatasetInput`) replaces
        the registered train loader for this call: each worker reads its own streaming-split shard.

        Example:
            >>> stats = trainer.train(profile=True)  # doctest: +SKIP
            >>> stats["train_loss"], stats["num_samples"], stats["profile"]["mean_fwd_s"]  # doctest: +SKIP
        """
        num_steps = attempts.check_num_steps(num_steps)  # before any work: None, or an int >= 0 (0: no batch)
        data = ray_data.as_input(dataset, self.training_operator_cls, num_steps) if dataset is not None else None
        reporter = self._progress.start(local=self.use_local) if self._progress is not None else None
        completed = False
        try:
            call = dict(num_steps=num_steps, profile=profile, info=dict(info or {}), lockstep=True,
                        replay=data is not None, on_tick=self._progress.tick if reporter is not None else None,
                        rank_kwargs=ray_data.rank_inputs(data, reporter, self._shards, self.worker_group,
                                                         self._requested_config, self.timeout_s,
                                                         self.num_cpus_per_worker))
            stats = attempts.run_call(self, "train_epoch", max_retries, call)
            completed = True
        finally:
            if reporter is not None:
                self._progress.finish(completed)
            if data is not None and (not completed or num_steps is not None):
                self._shards.drop()  # the split is mid-pass (stuck, or stopped by num_steps): split afresh next time
        return self._log_result("train", stats, reduce_results)

    def _log_result(self, phase, stats, reduce_results):
        """Reduce the per-worker stats, log them (``logdir``), checkpoint (``storage_path``), return what was asked."""
        reduced = reduce_worker_stats(stats)
        if self._results is not None:
            self._results.log(phase, reduced)
        self._durable.on_result(phase, reduced, self._take_snapshot)
        return reduced if reduce_results else stats

    def validate(self, num_steps=None, profile=False, reduce_results=True, info=None, max_retries=3):
        """Validate on every worker's shard of the validation set; returns the metrics.

        Example:
            >>> trainer.validate()["val_loss"]  # doctest: +SKIP
        """
        num_steps = attempts.check_num_steps(num_steps)
        stats = attempts.run_call(self, "validate", max_retries, dict(num_steps=num_steps, profile=profile,
                                                                        info=dict(info or {}), lockstep=True))
        return self._log_result("validate", stats, reduce_results)

    # ----------------------------------------------------------------- operators and models
    def _run(self, method, *args, **kwargs):
        """Run ``method`` everywhere; a lost worker restarts from the last snapshot at the next call."""
        self._ensure_workers()
        self._take_snapshot()  # a current restart point before anything can change the state
        try:
            result = self.worker_group.run(method, *args, **kwargs)
            self._snapshot_stale = True
            return result
        except WorkerFailure as failure:
            self._num_failures += 1
            raise RuntimeError(f"{method} failed: a worker was lost (it restarts at the next call).") from failure

    def apply_all_workers(self, fn):
        """Call ``fn()`` on every worker; returns the results in rank order."""
        shipping.install()  # fn may be sent by value (see raysgd.torch.shipping)
        return self._run("apply", fn)

    def apply_all_operators(self, fn):
        """Call ``fn(operator)`` on every worker's operator; returns the results in rank order."""
        shipping.install()
        return self._run("apply_operator", fn)

    def update_scheduler(self, metric):
        """Call ``scheduler.step(metric)`` on every worker (for ``scheduler_step_freq="manual"``)."""
        self._run("update_scheduler", metric)

    def get_model(self, to_cpu=False):
        """The trained model(s) of rank 0, unwrapped (no DDP): one model, or a list for several.

        With ``to_cpu=True`` they are CPU copies; the workers' own models never move.
        """
        self._ensure_workers()
        models = self._first_answer("get_models", to_cpu)
        return models[0] if len(models) == 1 else models

    def stack_traces(self, timeout_s=5.0):
        """``{rank: text}``: where every rank is now (its Python stacks); callable from another thread.

        Example:
            >>> threading.Thread(target=trainer.train).start()  # doctest: +SKIP
            >>> print(trainer.stack_traces()[1])  # doctest: +SKIP
        """
        return self.worker_group.stack_traces(timeout_s)

    def get_local_operator(self):
        """The rank-0 operator living in this process (needs ``use_local=True``)."""
        self._ensure_workers()
        local = self.worker_group.local_worker
        if local is None:
            raise NotImplementedError("get_local_operator() needs TorchTrainer(use_local=True).")
        return local.operator

    # ----------------------------------------------------------------- state
    def state_dict(self):
        """Rank 0's state: ``{epoch, global_step, operator, models, optimizers[, schedulers][, amp_*]}`` on CPU."""
        self._ensure_workers()
        self._snapshot_stale = True  # always the current state (custom validate, get_local_operator, ...)
        return checkpoint.state_from_bytes(self._take_snapshot())

    def latest_commit(self):
        """The latest complete commit of the running (or last) ``train()`` call as a state dict, or None.

        Its ``cursor`` and per-rank ``rng`` let :meth:`load_state_dict` resume that epoch exactly there.
        Example: ``trainer.latest_commit()["cursor"]["consumed"]``; safe from another thread during train().
        """
        return self._commits.latest_state()

    def load_state_dict(self, state_dict, blocking=False, weights_only=True):
        """Load ``state_dict`` (or its ``torch.save`` bytes) on every worker (each onto its own device).

        Bytes are loaded safely (``weights_only=True``, as :meth:`load`): checked in the driver, then on every
        worker; pass ``weights_only=False`` only for bytes you trust whose state needs other objects. A dict or
        bytes that are not a trainer state raise :class:`~raysgd.torch.errors.CheckpointError` before anything
        is sent. The call returns before the workers finish unless ``blocking``; later calls run after it.

        Example:
            >>> trainer.load_state_dict(other.state_dict(), blocking=True)  # doctest: +SKIP
        """
        self._load_stream(*checkpoint.checked_stream(state_dict, weights_only), blocking=blocking)

    def _load_stream(self, stream, weights_only=True, blocking=False):
        """Send checked state bytes to every worker (loaded there with ``weights_only``); they are the restart point."""
        self._ensure_workers()
        ref = ray.put(stream)
        if blocking:
            self._run("load_state_stream", ref, weights_only)
        else:
            self.worker_group.submit("load_state_stream", ref, weights_only)
        self._snapshot, self._snapshot_stale = stream, False

    def save(self, checkpoint_path):
        """Write the trainer state to ``checkpoint_path`` atomically (and to ``storage_path``); returns the path."""
        return checkpoint.save_state(self._durable.on_save(self.state_dict(), self._take_snapshot), checkpoint_path)

    def load(self, checkpoint_path, weights_only=True, blocking=False):
        """Load a file written by :meth:`save` (``weights_only=False`` only for trusted files; see README), or a
        checkpoint directory of ``storage_path`` or Tune (a local path or a URI such as ``s3://bucket/run/...``).
        Anything else (a text file, another pickle, a model's weights) raises
        :class:`~raysgd.torch.errors.CheckpointError` naming it, before anything is sent to the workers."""
        state = storage.read_path(checkpoint_path, weights_only=weights_only)  # checked: a dict or state bytes
        if isinstance(state, bytes):
            self._load_stream(state, weights_only, blocking=blocking)
        else:
            self._load_stream(checkpoint.state_to_bytes(state), weights_only=False, blocking=blocking)  # made here

    def restore(self, *args):
        """Removed in 1.x: always raises ``DeprecationWarning`` pointing at :meth:`load`."""
        raise DeprecationWarning("TorchTrainer.restore() is deprecated: use TorchTrainer.load(checkpoint).")

    def shutdown(self, force=False):
        """Stop the workers and release their resources; the trainer cannot be used afterwards. Waits for the last
        ``storage_path`` upload (at most ``SGD_CHECKPOINT_FLUSH_S``) and then raises its failure, if any."""
        group, self.worker_group = self.__dict__.get("worker_group"), _ShutDownGroup()
        upload_error = None
        try:
            if isinstance(group, WorkerGroup):
                group.shutdown(force=force)  # returns once Ray shows the resources free (bounded)
        finally:
            for name in ("_progress", "_results", "_shards", "_durable", "_commits"):  # bar, logs, uploads
                extra = self.__dict__.get(name)
                try:
                    if extra is not None:
                        extra.close()
                except Exception as err:  # noqa: BLE001 (close the others anyway)
                    logger.warning("Closing %s at shutdown failed: %s", name, err)
                    upload_error = err if name == "_durable" else upload_error
        if upload_error is not None:
            raise upload_error

    def _close_quietly(self):
        try:  # after a failed start: the start's error is the one to raise
            self.shutdown(force=True)
        except Exception as err:  # noqa: BLE001
            logger.warning("Closing the trainer after a failed start: %s", err)

    @classmethod
    def as_trainable(cls, *args, override_tune_step=None, **kwargs):
        """A Ray Tune ``Trainable`` class training with ``TorchTrainer(**kwargs)`` (see :mod:`raysgd.torch.integrations.tune`)."""
        from raysgd.torch.integrations.tune import make_trainable  # noqa: PLC0415 (Tune stays optional)

        return make_trainable(cls, *args, override_tune_step=override_tune_step, **kwargs)


def __getattr__(name):
    """``BaseTorchTrainable``, where 1.x defined it; :mod:`raysgd.torch.integrations.tune` imports Ray Tune, so on first use."""
    if name == "BaseTorchTrainable":
        from raysgd.torch.integrations.tune import BaseTorchTrainable  # noqa: PLC0415 (Tune stays optional until used)

        return BaseTorchTrainable
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
