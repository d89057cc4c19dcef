"""Keys and environment-tunable defaults (timeouts, cooldown): the one home of every constant.

Layer 0: standard library only. Every ``*_S`` value can be overridden by the environment
variable of the same name, read when this module is first imported; :func:`env_float` reads one
such variable at the time it is called (for values a test or a running job may change).

Example:
    >>> from raysgd.torch.constants import VALID_SCHEDULER_STEP
    >>> sorted(VALID_SCHEDULER_STEP)
    ['batch', 'epoch', 'manual']
"""
import os

#: Config key for the *global* batch size; each worker's config holds ``global // num_workers``
#: (public as ``raysgd.utils.BATCH_SIZE``, as in RaySGD 1.x).
BATCH_SIZE = "*batch_size"
#: Config key for the seed of the epoch's sample order (an int, the same on every worker; default 0, or the
#: loader's ``generator.initial_seed()``). Give each Tune trial its own to see different orders.
DATA_SEED = "data_seed"
#: Key in a worker's config: micro-batches per optimizer step (``fixed_worker_batch=True``; 1 otherwise).
ACCUMULATION_STEPS = "*accumulation_steps"
#: Key in ``info``: whether fp16 is on.
USE_FP16 = "__use_fp16__"
#: Key in ``info``: the ``num_steps`` the caller asked for.
NUM_STEPS = "__num_steps__"
#: Key in a worker's ``train_epoch`` result (taken out by the driver, never in a user's result): the seconds of the
#: latest commit this rank stored during the call (from its start until the store held it).
COMMIT_LATENCY = "__commit_latency_s__"
#: Kept for 1.x imports; never put into ``info``.
SCHEDULER_STEP = "scheduler_step"
SCHEDULER_STEP_BATCH = "batch"
SCHEDULER_STEP_EPOCH = "epoch"
SCHEDULER_STEP_MANUAL = "manual"
VALID_SCHEDULER_STEP = {SCHEDULER_STEP_BATCH, SCHEDULER_STEP_EPOCH, SCHEDULER_STEP_MANUAL}
#: Environment variable set by ``raysgd.compat.install()``: a process with it set maps ``ray.util.sgd``
#: to raysgd on ``import raysgd``; the worker group forwards it to its actors.
LEGACY_IMPORTS_ENV = "RAYSGD_LEGACY_IMPORTS"
#: Set by ``raysgd.compat.install_train()`` (``python -m raysgd.legacy --train``): ``ray.train`` maps to
#: ``raysgd.train`` on ``import raysgd``; forwarded to the actors like ``LEGACY_IMPORTS_ENV``.
TRAIN_IMPORTS_ENV = "RAYSGD_TRAIN_IMPORTS"


def env_float(name, default):
    """The environment variable ``name`` as a number, or ``default`` when it is unset or empty.

    Example:
        >>> env_float("RAYSGD_SURELY_UNSET_VARIABLE", 3)
        3.0
    """
    value = os.environ.get(name)
    if value is None or value == "":
        return float(default)
    try:
        return float(value)
    except ValueError as err:
        raise ValueError(f"environment variable {name} must be a number of seconds, got {value!r}") from err


#: Default process-group timeout for nccl (1.x name).
NCCL_TIMEOUT_S = env_float("NCCL_TIMEOUT_S", 1800)
#: How long to wait for a placement group to be placed.
SGD_PLACEMENT_GROUP_TIMEOUT_S = env_float("SGD_PLACEMENT_GROUP_TIMEOUT_S", 100)
#: Seconds after a resize before the pool may grow back to ``num_workers``.
RESIZE_COOLDOWN_S = env_float("SGD_RESIZE_COOLDOWN_S", 10)
#: Deadline for a graceful shutdown before actors are killed.
SGD_SHUTDOWN_TIMEOUT_S = env_float("SGD_SHUTDOWN_TIMEOUT_S", 10)
#: How many times a resize tries to start workers before it gives up.
SGD_MAX_RESTART_TRIES = int(env_float("SGD_MAX_RESTART_TRIES", 10))
#: Cap of the exponential backoff between restart tries.
SGD_BACKOFF_CAP_S = env_float("SGD_BACKOFF_CAP_S", 60)
#: How long ``train(dataset=...)`` waits for a worker's first batch when the trainer leaves Ray Data no CPU
#: (a materialized dataset needs no task and gives it at once); then a ``TimeoutError`` says what to free.
SGD_DATA_NO_CPU_S = env_float("SGD_DATA_NO_CPU_S", 10)
#: Seconds of training between two commits inside an epoch (``TorchTrainer(commit_every_n_steps=None)``).
SGD_COMMIT_INTERVAL_S = env_float("SGD_COMMIT_INTERVAL_S", 30)
#: How long ``TorchTrainer.shutdown()`` waits for the last ``storage_path`` checkpoint to be stored.
SGD_CHECKPOINT_FLUSH_S = env_float("SGD_CHECKPOINT_FLUSH_S", 600)
#: The longest epoch stream (sampler positions) drawn whole for the data cursor; a longer sampler, or one with
#: no length whose stream does not end, is sharded lazily without a cursor (``raysgd.torch.sharding.loaders.shard_loader``).
SGD_MAX_CURSOR_POSITIONS = int(env_float("SGD_MAX_CURSOR_POSITIONS", 2**24))
