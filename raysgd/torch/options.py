"""Every ``TorchTrainer`` option in one place: its default, its check and its doc line (:class:`TrainerOptions`).

Layer 5 (a root module: torch, layers 0-4; never the execution layer). ``TorchTrainer``'s constructor signature
(keyword-only), its checks, the trainer's attributes, the workers' options and the docs' TorchTrainer table
all come from the dataclass; ``TorchTrainer.as_trainable`` checks its resource arguments through it. Every error
names the argument, the expected form and the value given, before any actor starts. ``storage_path``,
``num_to_keep`` and ``resume`` are checked where the durable run opens (it writes a test file), ``logdir`` where
the result log opens, ``use_tqdm``'s tqdm where the progress bar is made: also before any actor starts.

Example:
    >>> TrainerOptions.default("num_workers"), worker_range((2, 4))
    (1, (2, 4))
    >>> TrainerOptions(num_workers=0).checked()
    Traceback (most recent call last):
    ...
    TypeError: TorchTrainer: training_operator_cls expects a subclass of raysgd.TrainingOperator; got None
"""
from __future__ import annotations

import collections.abc
import dataclasses
import inspect
import logging
import os

import torch

from raysgd.base.checks import (MAX_TIMEOUT_S, argument_error, expect, is_int, is_number, is_one_of, is_whole, plain,
                                takes_no_arguments)
from raysgd.callbacks import check_callbacks
from raysgd.torch.constants import BATCH_SIZE, DATA_SEED, VALID_SCHEDULER_STEP
from raysgd.torch.operator import fsdp
from raysgd.torch.operator.precision import validate_fp16
from raysgd.torch.sharding import batch_split
from raysgd.torch.commits.commit_policy import check_every_n
from raysgd.torch.training_operator import LightningOperator, TrainingOperator
from typing import Any, Callable

logger = logging.getLogger(__name__)

_CREATOR_HELP = ("Creator functions are deprecated: subclass TrainingOperator, create and register the training "
                 "state in its setup(), and pass it as training_operator_cls. To keep your creators, use "
                 "MyOperator = TrainingOperator.from_creators(model_creator, optimizer_creator, data_creator, ...) "
                 "and TorchTrainer(training_operator_cls=MyOperator).")
#: RaySGD 1.x keywords that are gone, and what to use instead (raised as ``DeprecationWarning``, as 1.12 did).
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


def check_deprecated(kwargs: dict[str, Any]) -> None:
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


def worker_range(num_workers: Any, caller: str = "TorchTrainer") -> tuple[int, int]:
    """``(min, max)`` workers as Python ints: an int ``N`` means ``(1, N)`` (1.x: up to N, down to 1); a tuple (or
    a list, as a JSON or YAML config gives it) is checked.

    Example:
        >>> worker_range(4), worker_range((2, 4)), worker_range([2, 4])
        ((1, 4), (2, 4), (2, 4))
        >>> worker_range((3, 2))
        Traceback (most recent call last):
        ValueError: TorchTrainer: num_workers expects an int >= 1 or a tuple (min, max) with 1 <= min <= max; got (3, 2)
    """
    expected = "an int >= 1 or a tuple (min, max) with 1 <= min <= max"
    if isinstance(num_workers, (tuple, list)):
        expect(len(num_workers) == 2 and all(is_whole(n) for n in num_workers), "num_workers", expected, num_workers,
               TypeError, caller)
        expect(1 <= num_workers[0] <= num_workers[1], "num_workers", expected, num_workers, caller=caller)
        return int(num_workers[0]), int(num_workers[1])
    expect(is_whole(num_workers), "num_workers", expected, num_workers, TypeError, caller)
    expect(num_workers >= 1, "num_workers", "an int >= 1", num_workers, caller=caller)
    return 1, int(num_workers)


def auto_backend(use_gpu: bool, num_gpus_per_worker: float = 1) -> str:
    """The process-group backend ``backend="auto"`` means: nccl for whole GPUs, else gloo.

    Workers holding a fraction of a GPU may share one device, which nccl refuses (one rank per GPU).

    Example:
        >>> auto_backend(True), auto_backend(True, 0.5), auto_backend(False)
        ('nccl', 'gloo', 'gloo')
    """
    return "nccl" if use_gpu and num_gpus_per_worker >= 1 else "gloo"


def check_num_steps(num_steps: Any) -> int | None:
    """``train()``/``validate()``'s ``num_steps`` as an int, or None (the rest of the epoch); 0 runs no batch.

    Example:
        >>> check_num_steps(2.5)
        Traceback (most recent call last):
        ...
        TypeError: num_steps expects None or an int >= 0 (batches per worker); got 2.5 (float)
    """
    if num_steps is None:
        return None
    expected = "None or an int >= 0 (batches per worker)"
    expect(is_whole(num_steps), "num_steps", expected, num_steps, TypeError,
           got=f"{num_steps!r} ({type(num_steps).__name__})")
    expect(num_steps >= 0, "num_steps", expected, num_steps)
    return int(num_steps)


def check_checkpoint_path(path: Any, caller: str) -> str | os.PathLike:
    """``save()``/``load()``'s ``checkpoint_path``: a non-empty ``str`` or ``os.PathLike`` (a local path or a URI),
    checked before any state is gathered or read.

    Example:
        >>> check_checkpoint_path(None, "save")
        Traceback (most recent call last):
        ...
        TypeError: save(checkpoint_path=...) expects a path or URI (str or os.PathLike); got NoneType None
    """
    expected = "a path or URI (str or os.PathLike)"
    expect(isinstance(path, (str, os.PathLike)), "checkpoint_path", expected, path, TypeError, caller, call=True,
           typed=True)
    expect(os.fspath(path) != "", "checkpoint_path", "a non-empty path or URI", path, caller=caller, call=True)
    return path


def check_info(info: Any, caller: str = "train") -> dict:
    """``train()``/``validate()``/``profile()``'s ``info`` (handed to ``train_epoch``/``validate``) as a new dict:
    a dict (any mapping) or None.

    Example:
        >>> check_info(None), check_info({"epoch_idx": 2})
        ({}, {'epoch_idx': 2})
        >>> check_info("epoch 2")
        Traceback (most recent call last):
        ...
        TypeError: train(info=...) expects a dict or None; got str 'epoch 2'
    """
    expect(info is None or isinstance(info, collections.abc.Mapping), "info", "a dict or None", info, TypeError,
           caller, call=True, typed=True)
    return dict(info or {})


# ----------------------------------------------------------------- the checks: f(values, caller) -> the value kept
def _operator_cls(v, caller):
    value = v["training_operator_cls"]
    expect(isinstance(value, type) and issubclass(value, TrainingOperator), "training_operator_cls",
           "a subclass of raysgd.TrainingOperator", value, TypeError, caller)
    expect(value.setup is not TrainingOperator.setup, "training_operator_cls",  # else every worker raises
           "a subclass of raysgd.TrainingOperator that implements setup(self, config)", value, TypeError, caller)
    return value


def check_hook(hook: Any, caller: str = "TorchTrainer") -> Callable[[], Any] | None:
    """``initialization_hook``: None, or a callable every worker calls with no arguments (a hook that needs some
    failed on every worker, once they had started).

    Example:
        >>> check_hook(lambda c: None)
        Traceback (most recent call last):
        TypeError: TorchTrainer: initialization_hook expects a callable taking no arguments, or None; got <lambda>(c)
    """
    expected = "a callable taking no arguments, or None"
    expect(hook is None or callable(hook), "initialization_hook", expected, hook, TypeError, caller)
    if hook is not None and not takes_no_arguments(hook):
        raise argument_error("initialization_hook", expected, hook, TypeError, caller=caller,
                             got=f"{getattr(hook, '__qualname__', type(hook).__name__)}{inspect.signature(hook)}")
    return hook


def _hook(v, caller):
    return check_hook(v["initialization_hook"], caller)


def _config(v, caller):
    config = v["config"]
    expect(config is None or isinstance(config, dict), "config", "a dict or None", config, TypeError, caller)
    seed = (config or {}).get(DATA_SEED)
    expect(seed is None or is_int(seed), "config[DATA_SEED]",
           "an int (the seed of the data order) or None", seed, TypeError, caller)
    return config


def _num_workers(v, caller):
    low, high = worker_range(v["num_workers"], caller)
    if high > 1 and not torch.distributed.is_available():
        raise ValueError("num_workers > 1 needs torch.distributed, which this torch build lacks")
    return (low, high) if isinstance(v["num_workers"], (tuple, list)) else high  # a range is kept as a tuple


def _cpus(v, caller):
    value = v["num_cpus_per_worker"]
    expect(is_number(value, above=0, finite=True), "num_cpus_per_worker", "a finite number > 0", value,
           caller=caller)
    return plain(value)


def _use_gpu(v, caller):
    expect(v["use_gpu"] == "auto" or isinstance(v["use_gpu"], bool), "use_gpu", "True, False or 'auto'", v["use_gpu"],
           caller=caller)
    return v["use_gpu"]


def _use_local(v, caller):
    expect(isinstance(v["use_local"], bool), "use_local", "True or False", v["use_local"], TypeError, caller)
    return v["use_local"]


def _gpus(v, caller):
    value = v["num_gpus_per_worker"]
    expect(is_number(value) and (0 < value < 1 or (value >= 1 and value % 1 == 0)), "num_gpus_per_worker",
           "a fraction in (0, 1) or a whole number >= 1", value, caller=caller)
    expect(v["use_gpu"] is not False or value == 1, "num_gpus_per_worker", "its default (1) when use_gpu=False",
           value, caller=caller)
    return plain(value)


def _backend(v, caller):
    backend, use_gpu, gpus = v["backend"], v["use_gpu"], v["num_gpus_per_worker"]
    expect(backend in ("auto", "gloo", "nccl"), "backend", "'auto', 'gloo' or 'nccl'", backend, caller=caller)
    backend = auto_backend(use_gpu, gpus) if backend == "auto" else backend
    expect(not (backend == "nccl" and not use_gpu), "backend", "'gloo' when use_gpu is False (nccl needs GPUs)",
           backend, caller=caller)
    expect(not (backend == "nccl" and gpus < 1), "backend",
           f"'gloo' with num_gpus_per_worker={gpus} (workers sharing a GPU; nccl needs one per rank)", backend,
           caller=caller)
    return backend


def _spares(v, caller):
    value = v["num_spares"]
    expect(is_whole(value, 0), "num_spares", "an int >= 0", value, caller=caller)
    return int(value)


def _timeout(v, caller):
    expect(is_number(v["timeout_s"], above=0, maximum=MAX_TIMEOUT_S), "timeout_s",
           f"a number of seconds > 0 (finite: at most {MAX_TIMEOUT_S:.0f})", v["timeout_s"], caller=caller)
    return plain(v["timeout_s"])


def _fp16(v, caller):
    try:
        validate_fp16(v["use_fp16"])
    except ValueError as err:
        raise argument_error("use_fp16", "False, True, 'apex' or 'bf16'", v["use_fp16"], caller=caller) from err
    return v["use_fp16"]


def _flag(name):
    def check(v, caller):
        expect(isinstance(v[name], bool), name, "True or False", v[name], TypeError, caller)
        return v[name]
    return check


def _step_freq(v, caller):
    value = v["scheduler_step_freq"]
    expect(not value or is_one_of(value, VALID_SCHEDULER_STEP), "scheduler_step_freq",
           f"one of {sorted(VALID_SCHEDULER_STEP)} or None", value, caller=caller)
    return value


def _fixed_worker_batch(v, caller):
    """``fixed_worker_batch`` and what it needs: no apex, ``BATCH_SIZE`` a multiple of the largest size."""
    fixed, max_workers = v["fixed_worker_batch"], worker_range(v["num_workers"])[1]
    expect(isinstance(fixed, bool), "fixed_worker_batch", "True or False", fixed, TypeError, caller)
    if not fixed:
        return False
    expect(v["use_fp16"] != "apex", "fixed_worker_batch=True", "use_fp16 False, True or 'bf16' (apex's loss scaling "
           "is not accumulation-aware here)", v["use_fp16"], caller=caller, got="use_fp16='apex'")
    operator = v["training_operator_cls"]  # the Lightning loop steps at every batch: the global batch would shrink
    expect(not (isinstance(operator, type) and issubclass(operator, LightningOperator)), "fixed_worker_batch=True",
           "a TrainingOperator whose loop accumulates gradients (TrainingOperator.from_ptl's Lightning loop steps the "
           "optimizer at every batch, and the module's own loaders set the batch size)", operator, caller=caller,
           got=f"{operator.__name__} (from_ptl)" if isinstance(operator, type) else None)
    total = (v["config"] or {}).get(BATCH_SIZE)
    expect(total is None or (is_whole(total, 1) and not total % max_workers), "config[BATCH_SIZE]",
           f"a multiple of the maximum number of workers ({max_workers}) with fixed_worker_batch=True", total,
           caller=caller)
    return True


def _commit_every(v, caller):
    return check_every_n(v["commit_every_n_steps"], caller)


def _strategy(v, caller):
    expect(v["placement_strategy"] in PLACEMENT_STRATEGIES, "placement_strategy",
           "one of " + ", ".join(map(repr, PLACEMENT_STRATEGIES)), v["placement_strategy"], caller=caller)
    return v["placement_strategy"]


def _parallel_strategy(v, caller):
    """``strategy`` ("ddp" or "fsdp") and what FSDP needs (torch, no apex, wrap_ddp, nccl on GPUs)."""
    return fsdp.check_strategy(v["strategy"], use_fp16=v["use_fp16"], wrap_ddp=v["wrap_ddp"],
                               use_gpu=v["use_gpu"], backend=v["backend"], caller=caller)


def _fsdp_args(v, caller):
    return fsdp.check_fsdp_args(v["fsdp_args"], v["strategy"], use_fp16=v["use_fp16"], use_gpu=v["use_gpu"],
                                caller=caller)


def _callbacks(v, caller):
    return check_callbacks(v["callbacks"], caller)


def option(default, doc, check=None, *, shown=None, attribute=False, worker=False, opened_by=None):
    """A field of :class:`TrainerOptions`: ``default``, ``doc`` (the docs table's line), ``check(values, caller)``
    returning the value kept; ``shown``: the table's default when not the value; ``attribute``: a ``TorchTrainer`` attribute;
    ``worker``: passed to every worker; ``opened_by``: checked where that part opens (no ``check`` here)."""
    return dataclasses.field(default=default, metadata={"doc": doc, "check": check, "shown": shown,
                                                        "attribute": attribute, "worker": worker,
                                                        "opened_by": opened_by})


@dataclasses.dataclass(frozen=True)
class TrainerOptions:
    """``TorchTrainer``'s options (the defaults follow RaySGD 1.12); :meth:`checked` gives them checked, with
    ``use_gpu`` and ``backend`` resolved from ``"auto"``.

    Example:
        >>> [f.name for f in dataclasses.fields(TrainerOptions)][:3]
        ['training_operator_cls', 'initialization_hook', 'config']
    """

    training_operator_cls: type = option(None, "your `TrainingOperator` subclass", _operator_cls, shown="required",
                                         attribute=True)
    initialization_hook: Callable[[], Any] | None = option(
        None, "zero-argument function run on every worker before the process group is set up (environment "
        "variables, seeding)", _hook)
    config: dict = option(
        None, "passed to `setup(config)`; `config[BATCH_SIZE]` is a global batch size divided among the workers (a "
        "`UserWarning` when it does not divide evenly; a `ValueError` when it is smaller than `num_workers`, or than "
        "the largest size of a range)", _config, shown="`{}`")
    num_workers: object = option(
        1, "data-parallel workers (1: no DDP, no process group); a tuple `(min, max)` is an elastic range (see Fault "
        "tolerance)", _num_workers)
    num_cpus_per_worker: float = option(
        1, "CPUs reserved per worker; the worker runs `torch.set_num_threads` with it", _cpus, attribute=True)
    use_gpu: object = option(
        "auto", "GPUs for the workers (`num_gpus_per_worker` each); `\"auto\"` means \"if CUDA is available\"",
        _use_gpu, attribute=True, worker=True)
    backend: str = option(
        "auto", "`\"gloo\"` or `\"nccl\"`; `\"auto\"` picks nccl with whole GPUs, gloo otherwise (nccl with a "
        "fractional `num_gpus_per_worker` is refused)", _backend, attribute=True, worker=True)
    wrap_ddp: bool = option(True, "wrap registered models in DistributedDataParallel", _flag("wrap_ddp"), worker=True)
    timeout_s: float = option(
        1800, "process-group timeout (every backend); also bounds how long a stuck worker can hold training",
        _timeout, attribute=True)
    use_fp16: object = option(False, "`False`, `True`, `\"bf16\"` or `\"apex\"` (see Mixed precision)", _fp16,
                              attribute=True, worker=True)
    use_tqdm: bool = option(False, "progress bar on the driver", _flag("use_tqdm"), attribute=True, worker=True)
    add_dist_sampler: bool = option(True, "shard registered DataLoaders across workers", _flag("add_dist_sampler"),
                                    worker=True)
    scheduler_step_freq: str = option(
        None, "`\"batch\"`, `\"epoch\"` or `\"manual\"` (then call `update_scheduler(metric)`; `ReduceLROnPlateau` "
        "needs `\"manual\"`, and `register()` refuses it otherwise)", _step_freq, attribute=True, worker=True)
    use_local: bool = option(False, "rank 0 runs inside the driver process (debuggers, `get_local_operator()`)",
                             _use_local, attribute=True)
    logdir: object = option(None, "append every result to CSV (and TensorBoard) files there (see below)",
                            opened_by="the result log")
    placement_strategy: str = option(
        "SPREAD", "strategy of the workers' placement group: `\"PACK\"`, `\"SPREAD\"`, `\"STRICT_PACK\"` or "
        "`\"STRICT_SPREAD\"`. GPU users want `\"PACK\"` (or `\"STRICT_PACK\"`), so that DDP's allreduce stays inside "
        "one node; 1.x's `\"SPREAD\"` puts each worker on a different node when it can. The elastic range counts "
        "what the strategy allows (`\"STRICT_SPREAD\"`: a node per worker; `\"STRICT_PACK\"`: one node), so a strict "
        "group never tears itself down to grow into a placement that cannot be made. Inside a Tune trial the "
        "trial's own placement group is used", _strategy)
    commit_every_n_steps: int = option(
        None, "commits inside an epoch: every that many steps; None: every `SGD_COMMIT_INTERVAL_S` seconds of "
        "training; 0: off (see Commits inside an epoch)", _commit_every)
    storage_path: str = option(
        None, "a folder or `s3://`/`gs://`/`hdfs://` URI: automatic checkpoints there, and resume from them (see "
        "Durable runs)", opened_by="the durable run")
    num_to_keep: int = option(2, "how many complete checkpoints `storage_path` keeps", opened_by="the durable run")
    resume: bool = option(True, "resume from the newest complete checkpoint in `storage_path`; False ignores them",
                          opened_by="the durable run")
    fixed_worker_batch: bool = option(
        False, "every worker trains on `BATCH_SIZE / max_workers` samples at every size of an elastic range, and "
        "accumulates micro-batches below the largest size, so the global batch stays the same (see Global batch); "
        "refused for `from_ptl`'s Lightning loop, which steps at every batch", _fixed_worker_batch)
    num_gpus_per_worker: float = option(
        1, "with `use_gpu`: a fraction in (0, 1) lets workers share a GPU (small models, or 2 ranks on a 1-GPU "
        "machine; the backend is then gloo, since nccl takes one rank per GPU), a whole number ≥ 1 reserves that "
        "many (the worker trains on the first; your operator may use the rest). Counted by placement, the elastic "
        "range and Tune's resource request", _gpus, attribute=True)
    callbacks: list = option(
        None, "a list of `raysgd.Callback` instances called on the driver after every result, durable checkpoint, "
        "worker failure, resize and at `shutdown()` (`raysgd.loggers.MLflowLogger` and `WandbLogger` are two; see "
        "Callbacks, MLflow and Ray metrics)", _callbacks, shown="`[]`")
    ray_metrics: bool = option(
        True, "record the run's steps/s, samples/s, workers, commit latency, checkpoint upload time, failures, "
        "resizes and checkpoints with `ray.util.metrics` (Ray's dashboard and Prometheus; see Callbacks, MLflow "
        "and Ray metrics)", _flag("ray_metrics"))
    strategy: str = option(
        "ddp", "`\"ddp\"` (DistributedDataParallel: the whole model on every worker) or `\"fsdp\"` (FSDP2's "
        "`fully_shard`: parameters, gradients and optimizer state sharded over the workers; torch ≥ 2.9; see Sharded "
        "models (FSDP2))", _parallel_strategy, attribute=True, worker=True)
    fsdp_args: dict = option(
        None, "with `strategy=\"fsdp\"`: `reshard_after_forward`, `mp_policy`, `offload_policy` (passed to "
        "`fully_shard`), `shard_policy` (the submodules sharded on their own before the root) and `validation` "
        "(`\"sharded\"`, the default, or `\"gathered\"`)", _fsdp_args,
        worker=True)
    num_spares: int = option(
        0, "warm spare workers kept idle beside the group, each with its own bundle of `num_cpus_per_worker` (and "
        "GPUs): a rank whose process dies is replaced by a spare, which has imported torch and run "
        "`initialization_hook` already, instead of a new process; refilled in the background; ignored inside a Tune "
        "trial (see Warm spares)", _spares)

    #: The order the checks run in (each may rely on those before it); ``use_gpu`` is resolved before ``backend``.
    ORDER = ("placement_strategy", "training_operator_cls", "initialization_hook", "config", "num_workers",
             "num_cpus_per_worker", "use_gpu", "use_local", "num_gpus_per_worker", "backend", "timeout_s", "use_fp16",
             "wrap_ddp", "use_tqdm", "add_dist_sampler", "scheduler_step_freq", "fixed_worker_batch",
             "strategy", "fsdp_args", "commit_every_n_steps", "callbacks", "ray_metrics", "num_spares")

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> TrainerOptions:
        """The checked options of ``TorchTrainer(**kwargs)``: 1.x's removed keywords raise their ``DeprecationWarning``
        and unknown ones a ``TypeError``, then every option is checked (:meth:`checked`)."""
        names = {f.name for f in dataclasses.fields(cls)}
        check_deprecated({k: v for k, v in kwargs.items() if k not in names})
        return cls(**{k: v for k, v in kwargs.items() if k in names}).checked()

    def checked(self) -> TrainerOptions:
        """These options checked in :data:`ORDER`, with ``"auto"`` resolved; then ``config[BATCH_SIZE]`` against the
        largest size (a worker's batch must hold a sample; an uneven split warns, naming ``BATCH_SIZE``)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in self.ORDER:
            if name == "backend":  # the resources are checked: "auto" means what this machine has
                values["use_gpu"] = torch.cuda.is_available() if values["use_gpu"] == "auto" else values["use_gpu"]
            values[name] = self.field(name).metadata["check"](values, "TorchTrainer")
        batch_split.split_batch_size(dict(values["config"] or {}), worker_range(values["num_workers"])[1])
        return dataclasses.replace(self, **values)

    @classmethod
    def field(cls, name: str) -> dataclasses.Field:
        """The dataclass field of option ``name``."""
        return next(f for f in dataclasses.fields(cls) if f.name == name)

    @classmethod
    def default(cls, name: str) -> Any:
        """The default of option ``name``."""
        return cls.field(name).default

    def worker_range(self) -> tuple[int, int]:
        """``(min, max)`` workers (see :func:`worker_range`)."""
        return worker_range(self.num_workers)

    def attributes(self) -> dict[str, Any]:
        """``{name: value}`` of the options a ``TorchTrainer`` shows as attributes."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata["attribute"]}

    def worker_options(self) -> dict[str, Any]:
        """``{name: value}`` of the options every worker gets (``TorchWorker``'s keyword arguments)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata["worker"]}

    @classmethod
    def signature(cls, first: str = "self") -> inspect.Signature:
        """The constructor's signature: ``first``, every option keyword-only with its default, then ``**deprecated``
        (1.x's removed keywords, refused with their messages)."""
        kind = inspect.Parameter.KEYWORD_ONLY
        return inspect.Signature([inspect.Parameter(first, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
                                 + [inspect.Parameter(f.name, kind, default=f.default) for f in dataclasses.fields(cls)]
                                 + [inspect.Parameter("deprecated", inspect.Parameter.VAR_KEYWORD)])

    @classmethod
    def readme_table(cls) -> str:
        """The TorchTrainer table of docs/trainer.md (Markdown): one row per option, its default and its doc line."""
        rows = ["| argument | default | meaning |", "|---|---|---|"]
        for f in dataclasses.fields(cls):
            shown = f.metadata["shown"] or (f'`"{f.default}"`' if isinstance(f.default, str) else str(f.default))
            rows.append(f"| `{f.name}` | {shown} | {f.metadata['doc']} |")
        return "\n".join(rows)


def check_resources(num_workers: Any, num_cpus_per_worker: float, use_gpu: bool | str,
                    use_local: bool, caller: str = "TorchTrainer", num_gpus_per_worker: float = 1) -> None:
    """Check the options that size the workers, with :class:`TrainerOptions`' checks (shared with the Tune resource
    request: ``caller="as_trainable"``). ``num_gpus_per_worker`` is a fraction in (0, 1) (several workers share one
    GPU) or a whole number >= 1.

    Example:
        >>> check_resources(0, 1, False, False, caller="as_trainable")
        Traceback (most recent call last):
        ValueError: as_trainable: num_workers expects an int >= 1; got 0
        >>> check_resources(2, 1, True, False, num_gpus_per_worker=1.5)
        Traceback (most recent call last):
        ValueError: TorchTrainer: num_gpus_per_worker expects a fraction in (0, 1) or a whole number >= 1; got 1.5
    """
    values = dict(num_workers=num_workers, num_cpus_per_worker=num_cpus_per_worker, use_gpu=use_gpu,
                  use_local=use_local, num_gpus_per_worker=num_gpus_per_worker)
    for name in ("num_workers", "num_cpus_per_worker", "use_gpu", "use_local", "num_gpus_per_worker"):
        TrainerOptions.field(name).metadata["check"](values, caller)
