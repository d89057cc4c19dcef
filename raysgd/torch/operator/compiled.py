"""``torch.compile``'d models: compiled outside DDP for training, saved and handed out as the plain module.

Layer 0 (torch only). A model registered as ``torch.compile(model, ...)`` is an ``OptimizedModule``
whose parameters live in ``model._orig_mod`` and whose ``state_dict`` keys carry an ``_orig_mod.`` prefix.
raysgd:

- trains ``compile(DDP(model))`` with the user's own compile options when it wraps models in DDP (PyTorch's
  advice: DDP's buckets then split the compiled graph, so gradient communication overlaps the backward
  pass); without DDP the registered compiled module trains as it is;
- captures, saves, commits and returns (``get_model``) the plain module, so checkpoints have the same keys
  whether or not the model was compiled, and load into either;
- still loads checkpoints written with the prefix (a compiled model saved by ``torch.save`` elsewhere, or by
  raysgd before this module existed).

Example:
    >>> model = torch.nn.Linear(1, 1)
    >>> original(model) is model, find_ddp(model)
    (True, None)
    >>> state = {"_orig_mod.weight": torch.ones(1, 1), "_orig_mod.bias": torch.zeros(1)}
    >>> load_model_state(model, state)
    >>> model.weight.item()
    1.0
"""
import logging
import sys

import torch
from torch.nn.parallel import DistributedDataParallel

logger = logging.getLogger(__name__)

#: The prefix ``OptimizedModule.state_dict()`` puts before every key.
PREFIX = "_orig_mod."


def compiled_inner(module):
    """The module inside ``module`` when it is ``torch.compile``'d (an ``OptimizedModule``), else None."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # loaded by any torch.compile call
    if eval_frame is not None and isinstance(module, eval_frame.OptimizedModule):
        return module._orig_mod
    return None


def original(module):
    """``module`` without its compile and DDP wrappers (in any order): the module whose state is saved."""
    while True:
        inner = compiled_inner(module)
        if inner is None and isinstance(module, DistributedDataParallel):
            inner = module.module
        if inner is None:
            return module
        module = inner


def find_ddp(value):
    """The ``DistributedDataParallel`` that ``value`` is, or that a compiled ``value`` wraps; else None."""
    while value is not None and not isinstance(value, DistributedDataParallel):
        value = compiled_inner(value)
    return value


def wrap_ddp(model, make_ddp):
    """``make_ddp(model)``, or for a compiled model ``compile(make_ddp(plain))`` with the model's own options.

    Example:
        >>> wrap_ddp(torch.nn.Linear(1, 1), lambda m: ("ddp", m))[0]
        'ddp'
    """
    inner = compiled_inner(model)
    if inner is None:
        return make_ddp(model)
    context = getattr(model, "dynamo_ctx", None)  # the compile call's context: backend, mode, options
    if context is None or not callable(context):
        logger.warning("Cannot re-apply this torch.compile to the DDP-wrapped model (torch %s): DDP wraps the "
                       "compiled module instead, so gradients are communicated after the compiled backward",
                       torch.__version__)
        return make_ddp(model)
    return context(make_ddp(inner))


def load_model_state(module, state):
    """``module.load_state_dict(state)`` (strict), also for a ``state`` whose every key has the compile prefix."""
    own = module.state_dict().keys()
    if state and not any(key in own for key in state) and all(key.startswith(PREFIX) for key in state):
        state = {key[len(PREFIX):]: value for key, value in state.items()}
    module.load_state_dict(state)
