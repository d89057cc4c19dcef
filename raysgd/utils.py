"""RaySGD 1.x's ``ray.util.sgd.utils``: the metric meters, timers, config keys and ``check_for_failure``.

Package glue (1.x's public path): it defines only 1.x's ``override`` and imports the rest from their homes
(:mod:`raysgd.meters`, :mod:`raysgd.timers`, :mod:`raysgd.torch.constants`); no library module imports it.

Example:
    >>> from raysgd.utils import AverageMeterCollection, NUM_SAMPLES
    >>> meters = AverageMeterCollection()
    >>> meters.update({"loss": 0.5}, n=32)
    >>> meters.update({"loss": 0.1}, n=32)
    >>> meters.summary()["loss"], meters.summary()["last_loss"]
    (0.3, 0.1)
"""
from raysgd.meters import BATCH_COUNT, NUM_SAMPLES, AverageMeter, AverageMeterCollection, to_host  # noqa: F401
from raysgd.timers import TimerCollection, TimerStat  # noqa: F401
from raysgd.torch.constants import BATCH_SIZE, DATA_SEED  # noqa: F401


def override(interface_class):
    """Decorator checking that a method really overrides one of ``interface_class``.

    Example:
        >>> class Base:
        ...     def setup(self, config): ...
        >>> class Mine(Base):
        ...     @override(Base)
        ...     def setup(self, config): ...
    """

    def check(method):
        if method.__name__ not in dir(interface_class):
            raise NameError(f"{method.__name__} does not override any method of {interface_class.__name__}")
        return method

    return check


def __getattr__(name):
    """``check_for_failure`` (1.x), defined with the worker group (it needs Ray) and imported on first use."""
    if name == "check_for_failure":
        from raysgd.torch.execution.calls import check_for_failure  # noqa: PLC0415 (imports Ray: on first use)

        return check_for_failure
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
