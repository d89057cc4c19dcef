"""CPU copies of models built straight from their tensors, never through a second copy on the device.

Layer 1 (torch only). ``copy.deepcopy(model).cpu()`` first clones every parameter and buffer on the
model's own device (a second full model in GPU memory, which can run out exactly when a big model
is fetched) and only then moves it. :func:`cpu_copy` seeds ``deepcopy``'s memo with a CPU clone of
every parameter and buffer, so the module tree is copied while each tensor is copied once, to CPU.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    >>> copied = cpu_copy(model)
    >>> copied is not model, copied[0].weight is not model[0].weight
    (True, True)
    >>> bool(torch.equal(copied[0].weight, model[0].weight)), copied[0].weight.device.type
    (True, 'cpu')
"""
import copy
import itertools

import torch


def _cpu_clone(tensor):
    """A CPU copy of a parameter or buffer: same values, ``requires_grad`` and gradient; no autograd history."""
    data = tensor.detach().to("cpu", copy=True)
    clone = torch.nn.Parameter(data, requires_grad=tensor.requires_grad) \
        if isinstance(tensor, torch.nn.Parameter) else data
    if tensor.grad is not None:
        clone.grad = tensor.grad.detach().to("cpu", copy=True)
    return clone


def cpu_copy(module):
    """A deep copy of ``module`` on CPU; ``module`` itself is untouched and none of its tensors is deep-copied.

    Parameters shared between submodules (tied weights) stay shared in the copy. Tensors kept as
    plain attributes (neither parameter nor buffer) are copied by ``deepcopy`` as before.

    Example:
        >>> import torch
        >>> cpu_copy(torch.nn.Linear(3, 1)).weight.shape
        torch.Size([1, 3])
    """
    memo = {}
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if id(tensor) not in memo:
            memo[id(tensor)] = _cpu_clone(tensor)
    return copy.deepcopy(module, memo).cpu()  # .cpu() moves only what deepcopy had to copy itself
