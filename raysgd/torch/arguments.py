"""Checking ``TorchTrainer``'s arguments before any actor starts, and splitting the global batch size.

Layer 5 helper of :mod:`raysgd.torch.torch_trainer`: standard library, torch and layers 0-2.
Every error names the argument, the expected form and the value given.

Example:
    >>> worker_range((2, 4))
    (2, 4)
"""
import logging
import numbers
import warnings

import torch

from raysgd.torch.constants import BATCH_SIZE, DATA_SEED, VALID_SCHEDULER_STEP
from raysgd.torch.operator.precision import validate_fp16
from raysgd.torch.training_operator import TrainingOperator

logger = logging.getLogger(__name__)

_CREATOR_HELP = ("Creator functions are deprecated: subclass TrainingOperator, create and register the training "
                 "state in its setup(), and pass it as training_operator_cls. To keep your creators, use "
                 "MyOperator = TrainingOperator.from_creators(model_creator, optimizer_creator, data_creator, ...) "
                 "and TorchTrainer(training_operator_cls=MyOperator).")
DEPRECATED = {
    "num_replicas": "num_replicas is deprecated: use num_workers instead.",
    "batch_size": ("batch_size is deprecated: use config={'batch_size': N} for a batch size per worker, or "
                   "config={raysgd.utils.BATCH_SIZE: N} for a global batch size divided among the workers."),
    "apex_args": ("apex_args is deprecated here: pass apex_args to self.register(...) in your TrainingOperator's "
                  "setup() instead."),
    "data_loader_args": ("data_loader_args is deprecated: return a torch.utils.data.DataLoader from your data "
                         "creator or register it in setup(); it is sharded across the workers by its own sampler."),
    "model_creator": _CREATOR_HELP, "data_creator": _CREATOR_HELP, "optimizer_creator": _CREATOR_HELP,
    "scheduler_creator": _CREATOR_HELP, "loss_creator": _CREATOR_HELP,
}
_warned_serialize = False
#: ``TorchTrainer(placement_strategy=...)``: Ray's placement-group strategies.
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def check_deprecated(kwargs):
    """Raise the 1.x ``DeprecationWarning`` for a removed keyword; unknown keywords are a ``TypeError``."""
    global _warned_serialize
    for name, value in kwargs.items():
        if name == "serialize_data_creation":
            if value is True and not _warned_serialize:
                logger.warning("serialize_data_creation is deprecated and ignored: serialise data loading in "
                               "TrainingOperator.setup (filelock.FileLock helps), as from_creators does.")
                _warned_serialize = True
        elif name in DEPRECATED:
            if value is not None and value is not False:
                raise DeprecationWarning(DEPRECATED[name])
        else:
            raise TypeError(f"TorchTrainer got an unexpected keyword argument {name!r}")


def _expect(condition, name, expected, value, error=ValueError, caller="TorchTrainer"):
    if not condition:
        raise error(f"{caller}: {name} expects {expected}; got {value!r}")


def check_resources(num_workers, num_cpus_per_worker, use_gpu, use_local, caller="TorchTrainer",
                    num_gpus_per_worker=1):
    """Check the arguments that size the workers (shared with the Tune resource request).

    ``num_gpus_per_worker`` is a fraction in (0, 1) (several workers share one GPU) or a whole number >= 1.

    Example:
        >>> check_resources(0, 1, False, False, caller="as_trainable")
        Traceback (most recent call last):
        ValueError: as_trainable: num_workers expects an int >= 1; got 0
        >>> check_resources(2, 1, True, False, num_gpus_per_worker=1.5)
        Traceback (most recent call last):
        ValueError: TorchTrainer: num_gpus_per_worker expects a fraction in (0, 1) or a whole number >= 1; got 1.5
    """
    worker_range(num_workers, caller)
    _expect(isinstance(num_cpus_per_worker, (int, float)) and not isinstance(num_cpus_per_worker, bool)
            and num_cpus_per_worker > 0, "num_cpus_per_worker", "a number > 0", num_cpus_per_worker, caller=caller)
    _expect(use_gpu == "auto" or isinstance(use_gpu, bool), "use_gpu", "True, False or 'auto'", use_gpu,
            caller=caller)
    _expect(isinstance(use_local, bool), "use_local", "True or False", use_local, TypeError, caller)
    _expect(isinstance(num_gpus_per_worker, (int, float)) and not isinstance(num_gpus_per_worker, bool)
            and (0 < num_gpus_per_worker < 1 or (num_gpus_per_worker >= 1 and num_gpus_per_worker % 1 == 0)),
            "num_gpus_per_worker", "a fraction in (0, 1) or a whole number >= 1", num_gpus_per_worker, caller=caller)
    _expect(use_gpu is not False or num_gpus_per_worker == 1, "num_gpus_per_worker",
            "its default (1) when use_gpu=False", num_gpus_per_worker, caller=caller)


def auto_backend(use_gpu, num_gpus_per_worker=1):
    """The process-group backend ``backend="auto"`` means: nccl for whole GPUs, else gloo.

    Workers holding a fraction of a GPU may share one device, which nccl refuses (one rank per GPU).

    Example:
        >>> auto_backend(True), auto_backend(True, 0.5), auto_backend(False)
        ('nccl', 'gloo', 'gloo')
    """
    return "nccl" if use_gpu and num_gpus_per_worker >= 1 else "gloo"


def worker_range(num_workers, caller="TorchTrainer"):
    """``(min, max)`` workers: an int ``N`` means ``(1, N)`` (1.x: up to N, down to 1); a tuple is checked.

    Example:
        >>> worker_range(4), worker_range((2, 4))
        ((1, 4), (2, 4))
        >>> worker_range((3, 2))
        Traceback (most recent call last):
        ValueError: TorchTrainer: num_workers expects an int >= 1 or a tuple (min, max) with 1 <= min <= max; got (3, 2)
    """
    expected = "an int >= 1 or a tuple (min, max) with 1 <= min <= max"
    if isinstance(num_workers, tuple):
        _expect(len(num_workers) == 2 and all(isinstance(n, int) and not isinstance(n, bool) for n in num_workers),
                "num_workers", expected, num_workers, TypeError, caller)
        _expect(1 <= num_workers[0] <= num_workers[1], "num_workers", expected, num_workers, caller=caller)
        return tuple(num_workers)
    _expect(isinstance(num_workers, int) and not isinstance(num_workers, bool), "num_workers", expected,
            num_workers, TypeError, caller)
    _expect(num_workers >= 1, "num_workers", "an int >= 1", num_workers, caller=caller)
    return 1, num_workers


def check_arguments(*, training_operator_cls, initialization_hook, config, num_workers, num_cpus_per_worker,
                    use_gpu, backend, wrap_ddp, timeout_s, use_fp16, use_tqdm, add_dist_sampler,
                    scheduler_step_freq, use_local, placement_strategy="SPREAD", num_gpus_per_worker=1):
    """Validate every constructor argument; returns ``(use_gpu, backend)`` with ``"auto"`` resolved."""
    _expect(placement_strategy in PLACEMENT_STRATEGIES, "placement_strategy",
            "one of " + ", ".join(map(repr, PLACEMENT_STRATEGIES)), placement_strategy)
    _expect(isinstance(training_operator_cls, type) and issubclass(training_operator_cls, TrainingOperator),
            "training_operator_cls", "a subclass of raysgd.TrainingOperator", training_operator_cls, TypeError)
    _expect(initialization_hook is None or callable(initialization_hook), "initialization_hook",
            "a callable taking no arguments, or None", initialization_hook, TypeError)
    _expect(config is None or isinstance(config, dict), "config", "a dict or None", config, TypeError)
    seed = (config or {}).get(DATA_SEED)
    _expect(seed is None or (isinstance(seed, numbers.Integral) and not isinstance(seed, bool)), "config[DATA_SEED]",
            "an int (the seed of the data order) or None", seed, TypeError)
    check_resources(num_workers, num_cpus_per_worker, use_gpu, use_local, num_gpus_per_worker=num_gpus_per_worker)
    use_gpu = torch.cuda.is_available() if use_gpu == "auto" else use_gpu
    _expect(backend in ("auto", "gloo", "nccl"), "backend", "'auto', 'gloo' or 'nccl'", backend)
    if backend == "auto":
        backend = auto_backend(use_gpu, num_gpus_per_worker)
    _expect(not (backend == "nccl" and not use_gpu), "backend", "'gloo' when use_gpu is False (nccl needs GPUs)",
            backend)
    _expect(not (backend == "nccl" and num_gpus_per_worker < 1), "backend",
            f"'gloo' with num_gpus_per_worker={num_gpus_per_worker} (workers sharing a GPU; nccl needs one per rank)",
            backend)
    _expect(isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool) and timeout_s > 0,
            "timeout_s", "a number of seconds > 0", timeout_s)
    try:
        validate_fp16(use_fp16)
    except ValueError as err:
        raise ValueError(f"TorchTrainer: use_fp16 expects False, True, 'apex' or 'bf16'; got {use_fp16!r}") from err
    for name, value in (("wrap_ddp", wrap_ddp), ("use_tqdm", use_tqdm), ("add_dist_sampler", add_dist_sampler)):
        _expect(isinstance(value, bool), name, "True or False", value, TypeError)
    _expect(not scheduler_step_freq or scheduler_step_freq in VALID_SCHEDULER_STEP, "scheduler_step_freq",
            f"one of {sorted(VALID_SCHEDULER_STEP)} or None", scheduler_step_freq)
    if worker_range(num_workers)[1] > 1 and not torch.distributed.is_available():
        raise ValueError("num_workers > 1 needs torch.distributed, which this torch build lacks")
    return use_gpu, backend
