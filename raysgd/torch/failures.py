"""Reading failed worker calls: one line per failure for ``WorkerFailure``, and 1.x's ``check_for_failure``.

Layer 4 helper of :mod:`raysgd.torch.worker_group` (ray and layer 0). A dead actor shows up as
``RayActorError``; a failed collective as :class:`~raysgd.torch.errors.CollectiveError`.

Example:
    >>> from raysgd.torch.errors import CollectiveError
    >>> describe(CollectiveError(1, "gloo timed out"))
    'gloo timed out'
    >>> describe(ValueError("bad\\nsecond line"))
    'ValueError: bad'
"""
import logging

import ray
from ray.exceptions import RayActorError

from raysgd.torch.errors import CollectiveError

logger = logging.getLogger(__name__)


def describe(err):
    """One line saying how a worker's call failed (a ``WorkerFailure`` cause)."""
    if isinstance(err, CollectiveError):
        return err.message
    if isinstance(err, RayActorError):
        return "worker process died (" + str(err).splitlines()[0][:200] + ")"
    return f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"


def check_for_failure(remote_values):
    """Wait for every ObjectRef in ``remote_values``; True if all succeeded, False (logged) if an actor died.

    RaySGD 1.x's ``ray.util.sgd.utils.check_for_failure``, kept for programs that call it on their own
    remote calls. An exception raised by the called code propagates (as ``ray.get`` raises it). Like 1.x
    it waits without a deadline; the trainer itself watches its workers under deadlines instead.

    Example:
        >>> refs = start_steps(actors)  # your actors' calls (ObjectRefs)  # doctest: +SKIP
        >>> if not check_for_failure(refs):  # doctest: +SKIP
        ...     restart(actors)
    """
    unfinished = list(remote_values)
    try:
        while unfinished:
            finished, unfinished = ray.wait(unfinished)  # one at a time: a death is seen at once
            ray.get(finished)
        return True
    except RayActorError as err:
        logger.warning("check_for_failure: a worker died: %s", describe(err))
    return False
