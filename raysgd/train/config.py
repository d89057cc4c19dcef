"""Ray Train's configuration objects: ScalingConfig, RunConfig, FailureConfig, CheckpointConfig, checked early.

Part of :mod:`raysgd.train` (layer 7, over :mod:`raysgd.torch.execution`). Every field is checked when the object
is made and again by ``TorchTrainer`` (which argument, what was expected, what was given), so bad input fails
before any actor starts. The fields Ray Train 2.58 deprecated raise its ``DeprecationWarning`` (as an exception,
as Ray Train does), and the fields it has that raysgd does not support raise ``NotImplementedError`` saying so.

Example:
    >>> ScalingConfig(num_workers=2).worker_range
    (2, 2)
    >>> ScalingConfig(num_workers=(1, 4)).total_resources
    {'CPU': 4}
    >>> ScalingConfig(num_workers="2")
    Traceback (most recent call last):
    ...
    TypeError: ScalingConfig(num_workers=...) expects an int >= 1 or a range (min, max) of ints; got str '2'
"""
import dataclasses
import os
import time

from raysgd.base import environment
from raysgd.base.checks import MAX_TIMEOUT_S, expect, is_int, is_number, is_path, plain
from raysgd.train.callback import check_callbacks
from typing import Any

#: The default of a deprecated field: any other value, None included, is refused (as in Ray Train 2.58).
DEPRECATED = "DEPRECATED"
_MIGRATION = "See https://github.com/ray-project/ray/issues/49454 for the context (Ray Train 2.x's migration)."


#: How the configs' errors name an argument and its value, as Ray Train's do: ``ScalingConfig(num_workers=...)``
#: expects ...; got str '2'.
_AS_CALL = {"call": True, "typed": True}


def _unsupported(owner, name, value, default, why):
    if value != default:
        raise NotImplementedError(f"{owner}({name}={value!r}) is not supported by raysgd.train: {why}")


@dataclasses.dataclass
class ScalingConfig:
    """How many workers and what each holds.

    Args:
        num_workers: an int >= 1, or an elastic range ``(min, max)``: start as many as fit (at least ``min``), grow
            towards ``max`` when resources come back, restart after a failure on as many as fit again.
        use_gpu: one GPU per worker (NCCL); CPU workers use gloo.
        resources_per_worker: ``{"CPU": n, "GPU": g}``; the keys are case-sensitive, as in Ray Train. raysgd
            reserves CPUs and GPUs only: ``"memory"`` and custom resources are refused. ``"GPU"`` above 0 needs
            ``use_gpu=True`` (and ``use_gpu=True`` a ``"GPU"`` above 0), as Ray Train requires.
        placement_strategy: the placement group's strategy (``"PACK"``, ``"SPREAD"``, ...).
        elastic_resize_monitor_interval_s: with a range, how often (seconds) a healthy run considers growing.
        trainer_resources: deprecated in Ray Train 2.x (raises its ``DeprecationWarning``).
        label_selector, accelerator_type, use_tpu, topology: Ray Train's; refused (not supported here).
        num_spares: raysgd's warm spares: idle worker processes beside the workers, ready to take a lost rank's
            place in a fraction of a second (see the operator API's ``TorchTrainer(num_spares=...)``); default 0.

    Without ``resources_per_worker`` a worker reserves 1 CPU (and 1 GPU with ``use_gpu``; Ray Train reserves no
    CPU for a GPU worker).

    Example:
        >>> ScalingConfig(num_workers=2, use_gpu=False).num_cpus_per_worker
        1
        >>> ScalingConfig(resources_per_worker={"GPU": 1})
        Traceback (most recent call last):
        ...
        ValueError: ScalingConfig: `use_gpu` is False but `GPU` was found in `resources_per_worker`. Either set `use_gpu` to True or remove `GPU` from `resources_per_worker`.
    """

    num_workers: Any = 1  # an int, or an elastic range (min, max): __post_init__ checks which
    use_gpu: bool = False
    resources_per_worker: dict | None = None
    placement_strategy: str = "PACK"
    elastic_resize_monitor_interval_s: float = 60.0
    trainer_resources: dict | None = None
    label_selector: object = None
    accelerator_type: str | None = None
    use_tpu: bool = False
    topology: str | None = None
    num_spares: int = 0

    def __post_init__(self):
        n = self.num_workers
        is_range = isinstance(n, (tuple, list)) and len(n) == 2 and all(is_int(x) for x in n) and 1 <= n[0] <= n[1]
        expect((is_int(n) and n >= 1) or is_range, "num_workers", "an int >= 1 or a range (min, max) of ints", n,
               TypeError, "ScalingConfig", **_AS_CALL)
        expect(isinstance(self.use_gpu, bool), "use_gpu", "a bool", self.use_gpu, TypeError, "ScalingConfig",
               **_AS_CALL)
        if self.trainer_resources is not None:
            raise DeprecationWarning("`ScalingConfig(trainer_resources)` is deprecated (as in Ray Train 2.x): the "
                                     "trainer runs in the driver process and reserves nothing; set the workers' "
                                     f"resources with `resources_per_worker`. {_MIGRATION}")
        self._check_resources(self.resources_per_worker)
        expect(is_int(self.num_spares, 0), "num_spares", "an int >= 0", self.num_spares, TypeError, "ScalingConfig",
               **_AS_CALL)
        expect(self.placement_strategy in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"), "placement_strategy",
               "'PACK', 'SPREAD', 'STRICT_PACK' or 'STRICT_SPREAD'", self.placement_strategy, ValueError,
               "ScalingConfig", **_AS_CALL)
        interval = self.elastic_resize_monitor_interval_s
        expect(is_number(interval, minimum=0), "elastic_resize_monitor_interval_s", "a number of seconds >= 0",
               interval, ValueError, "ScalingConfig", **_AS_CALL)
        why = "raysgd places workers by CPU and GPU count only"
        _unsupported("ScalingConfig", "label_selector", self.label_selector, None, why)
        _unsupported("ScalingConfig", "accelerator_type", self.accelerator_type, None, why)
        _unsupported("ScalingConfig", "use_tpu", self.use_tpu, False, "raysgd trains on CPUs and CUDA GPUs")
        _unsupported("ScalingConfig", "topology", self.topology, None, "raysgd trains on CPUs and CUDA GPUs")
        self.num_workers = plain(n) if is_int(n) else tuple(int(x) for x in n)  # numpy's, a list: Python's
        if self.resources_per_worker is not None:
            self.resources_per_worker = {key: plain(value) for key, value in self.resources_per_worker.items()}
        self.num_spares, self.elastic_resize_monitor_interval_s = int(self.num_spares), plain(interval)
        gpus = self.num_gpus_per_worker
        if self.resources_per_worker and not self.use_gpu and gpus > 0:
            raise ValueError("ScalingConfig: `use_gpu` is False but `GPU` was found in `resources_per_worker`. "
                             "Either set `use_gpu` to True or remove `GPU` from `resources_per_worker`.")
        if self.resources_per_worker and self.use_gpu and gpus == 0:
            raise ValueError("ScalingConfig: `use_gpu` is True but `GPU` is set to 0 in `resources_per_worker`. "
                             "Either set `use_gpu` to False or request a positive number of `GPU` in "
                             "`resources_per_worker`.")
        if self.num_cpus_per_worker == 0 and gpus == 0:  # Ray refuses a placement group bundle of nothing
            raise ValueError(f"ScalingConfig(resources_per_worker=...): a worker must reserve a 'CPU' or a 'GPU' "
                             f"amount above 0 (Ray places no bundle of zero resources); got "
                             f"{self.resources_per_worker!r}")

    @staticmethod
    def _check_resources(resources):
        expected = "None or a dict {'CPU': n, 'GPU': g} of amounts >= 0"
        expect(resources is None or isinstance(resources, dict), "resources_per_worker", expected, resources, TypeError,
               "ScalingConfig", **_AS_CALL)
        for key, value in (resources or {}).items():
            if isinstance(key, str) and key.upper() in ("CPU", "GPU") and key != key.upper():
                raise ValueError(f"ScalingConfig(resources_per_worker=...): the keys are case-sensitive (as in Ray "
                                 f"Train): use {key.upper()!r}, not {key!r}; got {resources!r}")
            if key not in ("CPU", "GPU"):
                raise ValueError(f"ScalingConfig(resources_per_worker=...): raysgd reserves 'CPU' and 'GPU' per "
                                 f"worker only ({key!r}: memory and custom resources are not supported); got "
                                 f"{resources!r}")
            expect(is_number(value, minimum=0), "resources_per_worker", expected, resources, TypeError, "ScalingConfig",
                   **_AS_CALL)

    @property
    def worker_range(self) -> tuple[int, int]:
        """``(min, max)`` workers."""
        return self.min_workers, self.max_workers

    @property
    def min_workers(self) -> int:
        """The fewest workers the run trains with (``num_workers``, or a range's minimum)."""
        return self.num_workers if is_int(self.num_workers) else int(self.num_workers[0])

    @property
    def max_workers(self) -> int:
        """The most workers the run trains with (``num_workers``, or a range's maximum)."""
        return self.num_workers if is_int(self.num_workers) else int(self.num_workers[1])

    @property
    def is_range(self) -> bool:
        """Whether ``num_workers`` is an elastic range ``(min, max)``."""
        return not is_int(self.num_workers)

    @property
    def elasticity_enabled(self) -> bool:
        """Whether ``num_workers`` is a range (Ray Train's name)."""
        return self.is_range

    @property
    def num_cpus_per_worker(self) -> float:
        """CPUs each worker reserves (``resources_per_worker["CPU"]``, default 1)."""
        cpus = (self.resources_per_worker or {}).get("CPU")
        return 1 if cpus is None else cpus

    @property
    def num_gpus_per_worker(self) -> float:
        """GPUs each worker reserves (``resources_per_worker["GPU"]``, default 1 with ``use_gpu``, else 0)."""
        gpus = (self.resources_per_worker or {}).get("GPU")
        return (1 if self.use_gpu else 0) if gpus is None else gpus

    @property
    def total_resources(self) -> dict[str, float]:
        """What the workers reserve in all, ``{"CPU": n, "GPU": g}`` (zeros left out); for a range, the upper bound
        (``max`` workers), as in Ray Train 2.58.

        Example:
            >>> ScalingConfig(num_workers=2, use_gpu=True, resources_per_worker={"CPU": 2, "GPU": 0.5}).total_resources
            {'CPU': 4, 'GPU': 1.0}
        """
        per_worker = {"CPU": self.num_cpus_per_worker, "GPU": self.num_gpus_per_worker}
        return {key: value * self.max_workers for key, value in per_worker.items() if value}


@dataclasses.dataclass
class FailureConfig:
    """How many failures a run recovers from, each restarting from the latest reported checkpoint.

    Args:
        max_failures: failures of the workers or of the training function recovered from (0: none, -1: no limit).
        max_preemption_failures: preemptions (a node drained or SIGTERMed) recovered from, counted apart from
            ``max_failures`` (-1, the default: no limit).
        controller_failure_limit: Ray Train's limit on failures of its controller actor; raysgd's controller runs
            in the driver process, so a crash of it ends the script (run it again with the same ``RunConfig(name,
            storage_path)`` to resume). Checked, otherwise without effect.
        fail_fast: deprecated in Ray Train 2.x (raises its ``DeprecationWarning``).

    Example:
        >>> FailureConfig(max_failures=-1).max_failures
        -1
    """

    max_failures: int = 0
    fail_fast: object = DEPRECATED
    controller_failure_limit: int = -1
    max_preemption_failures: int = -1

    def __post_init__(self):
        if self.fail_fast != DEPRECATED:
            raise DeprecationWarning("`FailureConfig(fail_fast)` is deprecated (as in Ray Train 2.x): it concerned "
                                     f"several trials under Ray Tune; set `max_failures=0` to fail at once. {_MIGRATION}")
        for name in ("max_failures", "controller_failure_limit", "max_preemption_failures"):
            value = getattr(self, name)
            expect(is_int(value, -1), name, "an int >= -1 (-1: no limit)", value, TypeError, "FailureConfig", **_AS_CALL)
            setattr(self, name, int(value))  # numpy's: Python's


@dataclasses.dataclass
class CheckpointConfig:
    """Which reported checkpoints stay in storage (see :mod:`raysgd.train.retention` for the rules).

    Args:
        num_to_keep: how many to keep (None: all); the oldest go, or the lowest-scoring with a score attribute.
            The latest is never deleted (a restart resumes from it), so one more may stay.
        checkpoint_score_attribute: a key of the metrics reported with each checkpoint (``"a/b"`` for a nested
            one) whose number ranks them; None ranks by age.
        checkpoint_score_order: ``"max"`` (the highest is best) or ``"min"``.
        checkpoint_frequency, checkpoint_at_end: deprecated in Ray Train 2.x (raise its ``DeprecationWarning``).

    Example:
        >>> CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="val_loss", checkpoint_score_order="min").num_to_keep
        2
    """

    num_to_keep: int | None = None
    checkpoint_score_attribute: str | None = None
    checkpoint_score_order: str = "max"
    checkpoint_frequency: object = DEPRECATED
    checkpoint_at_end: object = DEPRECATED

    def __post_init__(self):
        for name in ("checkpoint_frequency", "checkpoint_at_end"):
            if getattr(self, name) != DEPRECATED:
                raise DeprecationWarning(f"`{name}` is deprecated since it does not apply to user-defined training "
                                         f"functions (as in Ray Train 2.x). Please remove this argument from your "
                                         f"CheckpointConfig.")
        expect(self.num_to_keep is None or is_int(self.num_to_keep), "num_to_keep", "None or an int >= 1",
               self.num_to_keep, TypeError, "CheckpointConfig", **_AS_CALL)
        expect(self.num_to_keep is None or self.num_to_keep >= 1, "num_to_keep", "None or an int >= 1",
               self.num_to_keep, ValueError, "CheckpointConfig", **_AS_CALL)
        self.num_to_keep = None if self.num_to_keep is None else int(self.num_to_keep)  # numpy's: Python's
        score = self.checkpoint_score_attribute
        expect(score is None or (isinstance(score, str) and score), "checkpoint_score_attribute",
               "None or a metric's name (str)", score, TypeError, "CheckpointConfig", **_AS_CALL)
        expect(self.checkpoint_score_order in ("max", "min"), "checkpoint_score_order", "'max' or 'min'",
               self.checkpoint_score_order, ValueError, "CheckpointConfig", **_AS_CALL)


@dataclasses.dataclass
class LoggingConfig:
    """The level of raysgd's own log lines (``"DEBUG"``, ``"INFO"``, ...) during a run: ``fit()`` sets it with
    :func:`raysgd.set_log_level` (the driver and the workers it starts) and puts the previous one back at its end.
    The default, None, leaves raysgd's level as it is (``RAYSGD_LOG_LEVEL`` or ``raysgd.set_log_level``; INFO
    without either), where Ray Train's default is ``"INFO"``.

    Example:
        >>> LoggingConfig("debug").log_level
        'DEBUG'
    """

    log_level: str | None = None

    def __post_init__(self):
        if self.log_level is None:
            return
        levels = sorted(environment.LOG_LEVELS)  # raysgd.set_log_level's names, which fit() hands it to
        expect(isinstance(self.log_level, str) and self.log_level.upper() in levels, "log_level",
               f"one of {levels} or None", self.log_level, ValueError, "LoggingConfig", **_AS_CALL)
        self.log_level = self.log_level.upper()


_RUN_CONFIG_DEPRECATED = ("sync_config", "verbose", "stop", "progress_reporter", "log_to_file")


@dataclasses.dataclass
class RunConfig:
    """Where a run's checkpoints go: ``storage_path/name/`` (a folder or a pyarrow.fs URI such as ``s3://b/p``).

    Re-running a script with the same ``name`` and ``storage_path`` resumes from the latest reported checkpoint.
    ``name`` defaults to ``TorchTrainer_<date>_<time>`` (a fresh run each time, as in Ray Train: pass a name to
    resume) and ``storage_path`` to ``~/ray_results``.

    Args:
        callbacks: :class:`~raysgd.train.UserCallback` instances and raysgd's callbacks and loggers
            (:class:`raysgd.Callback`, ``raysgd.loggers.MLflowLogger``, ``WandbLogger``), called on the driver.
        logging_config: :class:`LoggingConfig`.
        progress_bar: raysgd's: one tqdm bar on the driver's stderr, fed by rank 0's first prepared loader (its
            batches of the running epoch, and the loss last reported), as the operator API's ``use_tqdm=True``.
        storage_filesystem, worker_runtime_env: Ray Train's; refused (pass a URI as ``storage_path``; install what
            the workers need on the cluster's nodes).
        sync_config, verbose, stop, progress_reporter, log_to_file: deprecated in Ray Train 2.x (raise its
            ``DeprecationWarning``).

    Example:
        >>> RunConfig(name="exp", storage_path="/tmp/results").name
        'exp'
    """

    name: str = None  # type: ignore[assignment]  # None: __post_init__ sets it
    storage_path: str = None  # type: ignore[assignment]  # None: __post_init__ sets it
    storage_filesystem: object = None
    failure_config: FailureConfig = None  # type: ignore[assignment]  # None: __post_init__ sets it
    checkpoint_config: CheckpointConfig = None  # type: ignore[assignment]  # None: __post_init__ sets it
    callbacks: list = None  # type: ignore[assignment]  # None: __post_init__ sets it
    worker_runtime_env: dict = None  # type: ignore[assignment]  # None: __post_init__ sets it
    logging_config: LoggingConfig = None  # type: ignore[assignment]  # None: __post_init__ sets it
    progress_bar: bool = False
    sync_config: object = DEPRECATED
    verbose: object = DEPRECATED
    stop: object = DEPRECATED
    progress_reporter: object = DEPRECATED
    log_to_file: object = DEPRECATED

    def __post_init__(self):
        for name in _RUN_CONFIG_DEPRECATED:
            if getattr(self, name) != DEPRECATED:
                raise DeprecationWarning(f"`RunConfig({name})` is deprecated. This configuration was a Ray Tune API "
                                         f"that did not support Ray Train usage well, so Ray Train 2.x (and "
                                         f"raysgd.train) dropped it. {_MIGRATION}")
        expect(self.name is None or (isinstance(self.name, str) and self.name and "/" not in self.name), "name",
               "None or a non-empty str without '/'", self.name, TypeError, "RunConfig", **_AS_CALL)
        expect(self.storage_path is None or isinstance(self.storage_path, (str, os.PathLike)), "storage_path",
               "None, a folder path or a URI (str)", self.storage_path, TypeError, "RunConfig", **_AS_CALL)
        expect(self.storage_path is None or is_path(self.storage_path), "storage_path",  # "" would be the root "/"
               "None or a non-empty folder path or URI", self.storage_path, ValueError, "RunConfig", **_AS_CALL)
        _unsupported("RunConfig", "storage_filesystem", self.storage_filesystem, None,
                     "pass the location as a URI in storage_path (s3://bucket/path?endpoint_override=...)")
        _unsupported("RunConfig", "worker_runtime_env", self.worker_runtime_env or None, None,
                     "the workers run in the cluster's environment: install what they need on its nodes")
        expect(self.failure_config is None or isinstance(self.failure_config, FailureConfig), "failure_config",
               "a raysgd.train.FailureConfig", self.failure_config, TypeError, "RunConfig", **_AS_CALL)
        expect(self.checkpoint_config is None or isinstance(self.checkpoint_config, CheckpointConfig),
               "checkpoint_config", "a raysgd.train.CheckpointConfig", self.checkpoint_config, TypeError, "RunConfig",
               **_AS_CALL)
        expect(self.logging_config is None or isinstance(self.logging_config, LoggingConfig), "logging_config",
               "a raysgd.train.LoggingConfig", self.logging_config, TypeError, "RunConfig", **_AS_CALL)
        expect(isinstance(self.progress_bar, bool), "progress_bar", "a bool", self.progress_bar, TypeError, "RunConfig",
               **_AS_CALL)
        self.callbacks = check_callbacks(self.callbacks)
        self.failure_config = self.failure_config or FailureConfig()
        self.checkpoint_config = self.checkpoint_config or CheckpointConfig()
        self.logging_config = self.logging_config or LoggingConfig()
        self.worker_runtime_env = {}
        self.name = self.name or time.strftime("TorchTrainer_%Y-%m-%d_%H-%M-%S")
        self.storage_path = os.fspath(self.storage_path) if self.storage_path is not None else \
            os.path.expanduser(os.path.join("~", "ray_results"))


@dataclasses.dataclass
class TorchConfig:
    """The process group: ``backend`` (default gloo on CPU, nccl with GPUs) and its ``timeout_s``.

    Example:
        >>> TorchConfig(backend="gloo", timeout_s=60).timeout_s
        60
    """

    backend: str | None = None
    init_method: str = "env"  # Ray Train's order: TorchConfig("gloo", "env", 60) reads as there
    timeout_s: int = 1800

    def __post_init__(self):
        expect(self.backend in (None, "gloo", "nccl"), "backend", "None, 'gloo' or 'nccl'", self.backend, ValueError,
               "TorchConfig", **_AS_CALL)
        expect(self.init_method in ("env", "tcp"), "init_method", "'env' or 'tcp' (as in Ray Train; raysgd forms the "
               "group its own way with either)", self.init_method, ValueError, "TorchConfig", **_AS_CALL)
        expect(is_number(self.timeout_s, above=0), "timeout_s", "a number of seconds > 0", self.timeout_s, TypeError,
               "TorchConfig", **_AS_CALL)
        expect(is_number(self.timeout_s, maximum=MAX_TIMEOUT_S), "timeout_s", f"a finite number of seconds (at most "
               f"{MAX_TIMEOUT_S:.0f}: the process group's timeout is a datetime.timedelta)", self.timeout_s,
               ValueError, "TorchConfig", **_AS_CALL)
        self.timeout_s = plain(self.timeout_s)  # a np.int64: datetime.timedelta refuses it
