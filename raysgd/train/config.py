"""Ray Train's configuration objects: ScalingConfig, RunConfig, FailureConfig, CheckpointConfig, checked early.

Part of :mod:`raysgd.train` (layer 6, over :mod:`raysgd.torch.execution`). Every field is checked when the object
is made and again by ``TorchTrainer`` (which argument, what was expected, what was given), so bad input fails
before any actor starts.

Example:
    >>> ScalingConfig(num_workers=2).worker_range
    (2, 2)
    >>> ScalingConfig(num_workers=(1, 4)).worker_range
    (1, 4)
    >>> ScalingConfig(num_workers="2")
    Traceback (most recent call last):
    ...
    TypeError: ScalingConfig(num_workers=...) expects an int >= 1 or a range (min, max) of ints; got str '2'
"""
import dataclasses
import os
import time


def _int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _expect(ok, owner, name, expected, value, error=TypeError):
    if not ok:
        raise error(f"{owner}({name}=...) expects {expected}; got {type(value).__name__} {value!r}")


@dataclasses.dataclass
class ScalingConfig:
    """How many workers and what each holds.

    Args:
        num_workers: an int, or raysgd's elastic range ``(min, max)``: start as many as fit (at least ``min``) and
            restart after a failure on as many as fit again.
        use_gpu: one GPU per worker (NCCL); CPU workers use gloo.
        resources_per_worker: ``{"CPU": n, "GPU": g}`` (other keys are refused).
        trainer_resources, placement_strategy: as in Ray Train (the trainer itself runs in the driver here).

    Example:
        >>> ScalingConfig(num_workers=2, use_gpu=False).num_cpus_per_worker
        1
    """

    num_workers: object = 1
    use_gpu: bool = False
    resources_per_worker: dict = None
    trainer_resources: dict = None
    placement_strategy: str = "PACK"

    def __post_init__(self):
        n = self.num_workers
        is_range = isinstance(n, (tuple, list)) and len(n) == 2 and all(_int(x) for x in n) and 1 <= n[0] <= n[1]
        _expect((_int(n) and n >= 1) or is_range, "ScalingConfig", "num_workers",
                "an int >= 1 or a range (min, max) of ints", n)
        _expect(isinstance(self.use_gpu, bool), "ScalingConfig", "use_gpu", "a bool", self.use_gpu)
        resources = self.resources_per_worker
        _expect(resources is None or (isinstance(resources, dict) and set(resources) <= {"CPU", "GPU", "cpu", "gpu"}
                                      and all(isinstance(v, (int, float)) and v >= 0 for v in resources.values())),
                "ScalingConfig", "resources_per_worker", "None or a dict of 'CPU'/'GPU' amounts >= 0", resources)
        _expect(self.placement_strategy in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"), "ScalingConfig",
                "placement_strategy", "'PACK', 'SPREAD', 'STRICT_PACK' or 'STRICT_SPREAD'", self.placement_strategy,
                ValueError)

    @property
    def worker_range(self):
        """``(min, max)`` workers."""
        n = self.num_workers
        return (n, n) if _int(n) else (int(n[0]), int(n[1]))

    @property
    def is_range(self):
        """True when ``num_workers`` is an elastic range ``(min, max)``."""
        return not _int(self.num_workers)

    def _resource(self, key):
        resources = {k.upper(): v for k, v in (self.resources_per_worker or {}).items()}
        return resources.get(key)

    @property
    def num_cpus_per_worker(self):
        """CPUs per worker: ``resources_per_worker["CPU"]``, default 1."""
        cpus = self._resource("CPU")
        return 1 if cpus is None else cpus

    @property
    def num_gpus_per_worker(self):
        """GPUs per worker: ``resources_per_worker["GPU"]``, default 1 with ``use_gpu``, else 0."""
        gpus = self._resource("GPU")
        return (1 if self.use_gpu else 0) if gpus is None else gpus


@dataclasses.dataclass
class FailureConfig:
    """How many worker failures a run recovers from: ``max_failures`` (0: none, -1: no limit).

    Example:
        >>> FailureConfig(max_failures=-1).max_failures
        -1
    """

    max_failures: int = 0
    fail_fast: bool = False

    def __post_init__(self):
        _expect(_int(self.max_failures) and self.max_failures >= -1, "FailureConfig", "max_failures",
                "an int >= -1 (-1: no limit)", self.max_failures)


@dataclasses.dataclass
class CheckpointConfig:
    """Which reported checkpoints stay in storage: the newest ``num_to_keep`` (None: all).

    Example:
        >>> CheckpointConfig(num_to_keep=2).num_to_keep
        2
    """

    num_to_keep: int = None
    checkpoint_score_attribute: str = None
    checkpoint_score_order: str = "max"

    def __post_init__(self):
        _expect(self.num_to_keep is None or (_int(self.num_to_keep) and self.num_to_keep >= 1), "CheckpointConfig",
                "num_to_keep", "None or an int >= 1", self.num_to_keep)
        if self.checkpoint_score_attribute is not None:
            raise NotImplementedError("CheckpointConfig(checkpoint_score_attribute=...) is not supported by raysgd.train: "
                                      "the newest num_to_keep checkpoints are kept")


@dataclasses.dataclass
class RunConfig:
    """Where a run's checkpoints go: ``storage_path/name/`` (a folder or a pyarrow.fs URI such as ``s3://b/p``).

    Re-running a script with the same ``name`` and ``storage_path`` resumes from the latest reported checkpoint.
    ``name`` defaults to ``TorchTrainer_<date>_<time>`` (a fresh run each time, as in Ray Train: pass a name to
    resume) and ``storage_path`` to ``~/ray_results``.

    Example:
        >>> RunConfig(name="exp", storage_path="/tmp/results").name
        'exp'
    """

    name: str = None
    storage_path: str = None
    failure_config: FailureConfig = None
    checkpoint_config: CheckpointConfig = None
    verbose: int = None
    callbacks: list = None

    def __post_init__(self):
        _expect(self.name is None or (isinstance(self.name, str) and self.name and "/" not in self.name), "RunConfig",
                "name", "None or a non-empty str without '/'", self.name)
        _expect(self.storage_path is None or isinstance(self.storage_path, (str, os.PathLike)), "RunConfig",
                "storage_path", "None, a folder path or a URI (str)", self.storage_path)
        _expect(self.failure_config is None or isinstance(self.failure_config, FailureConfig), "RunConfig",
                "failure_config", "a raysgd.train.FailureConfig", self.failure_config)
        _expect(self.checkpoint_config is None or isinstance(self.checkpoint_config, CheckpointConfig), "RunConfig",
                "checkpoint_config", "a raysgd.train.CheckpointConfig", self.checkpoint_config)
        if self.callbacks:
            raise NotImplementedError("RunConfig(callbacks=...) (Ray Tune callbacks) is not supported by "
                                      "raysgd.train: log from the training function, or use raysgd.TorchTrainer's "
                                      "callbacks")
        self.failure_config = self.failure_config or FailureConfig()
        self.checkpoint_config = self.checkpoint_config or CheckpointConfig()
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

    backend: str = None
    timeout_s: int = 1800
    init_method: str = "env"

    def __post_init__(self):
        _expect(self.backend in (None, "gloo", "nccl"), "TorchConfig", "backend", "None, 'gloo' or 'nccl'",
                self.backend, ValueError)
        _expect(isinstance(self.timeout_s, (int, float)) and not isinstance(self.timeout_s, bool)
                and self.timeout_s > 0, "TorchConfig", "timeout_s", "a number of seconds > 0", self.timeout_s)
