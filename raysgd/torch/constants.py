"""Keys of configs, results and ``info``, and the environment's tunables by their 1.x names: one home for each.

Layer 0: standard library only. The tunables (``NCCL_TIMEOUT_S``, ``SGD_PLACEMENT_GROUP_TIMEOUT_S``,
``RESIZE_COOLDOWN_S``...) are the environment variables of :mod:`raysgd.base.environment`, read when asked for
(``constants.SGD_PLACEMENT_GROUP_TIMEOUT_S`` is the variable's value now); raysgd itself reads them through
:func:`raysgd.base.environment.get`.

Example:
    >>> from raysgd.torch.constants import VALID_SCHEDULER_STEP
    >>> sorted(VALID_SCHEDULER_STEP)
    ['batch', 'epoch', 'manual']
    >>> from raysgd.torch import constants
    >>> constants.RESIZE_COOLDOWN_S, constants.SGD_PLACEMENT_GROUP_TIMEOUT_S
    (10.0, 100.0)
"""
from raysgd.base import environment

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
#: Attributes of this module naming an environment variable of another name (1.x's ``worker_group.RESIZE_COOLDOWN_S``).
_ALIASES = {"RESIZE_COOLDOWN_S": "SGD_RESIZE_COOLDOWN_S"}


def __getattr__(name):
    """The environment's tunables by their 1.x names (``NCCL_TIMEOUT_S``, ``SGD_PLACEMENT_GROUP_TIMEOUT_S``, and
    ``RESIZE_COOLDOWN_S`` for ``SGD_RESIZE_COOLDOWN_S``) and every other variable of
    :data:`raysgd.base.environment.VARIABLES`, read from the environment when asked for."""
    variable = _ALIASES.get(name, name)
    if variable in environment.VARIABLES:
        return environment.get(variable)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
