"""How the driver ships user classes and functions to Ray processes: torch's config modules go by name.

Layer 0 (torch and the standard library). Ray sends a class defined in a script's ``__main__`` or inside
a function by value (cloudpickle), and with each method the modules it uses. For a module global such as
``dist`` (``import torch.distributed as dist``), cloudpickle also sends every already-imported submodule
whose name is among the method's names: a method that uses ``dist`` and reads ``self.config`` takes
``torch.distributed.config`` along. That is a torch config module (an instance of a subclass of
``torch.utils._config_module.ConfigModule``, one class per config module), which pickle refuses:
``TypeError: cannot pickle 'ConfigModuleInstance' object``, so such an operator could not start.

:func:`install` registers :func:`reduce_config_module` with ``copyreg`` (which pickle, cloudpickle and
Ray's serializer all consult) for the class of every config module imported so far: the module is sent
by its name and the receiving process imports it, getting its own torch's config, as it does for any
module global. :mod:`raysgd.torch` registers it when one of its names is first imported (they load lazily);
``TorchTrainer`` (before it starts workers, when it starts a worker, before ``apply_all_*``), ``raysgd.train``'s
trainer and ``as_trainable`` (before Tune pickles the trainable) register again, for config modules imported since.

Example:
    >>> import pickle
    >>> import torch.distributed as dist
    >>> install() > 0
    True
    >>> pickle.loads(pickle.dumps(dist.config)) is dist.config
    True
"""
import copyreg
import importlib
import sys

try:
    from torch.utils._config_module import ConfigModule
except ImportError:  # a torch without config modules: nothing to register
    ConfigModule = None  # type: ignore[misc,assignment]  # the name stays bound: install() tests it for None

_registered: set[type] = set()


def install():
    """Register :func:`reduce_config_module` for every torch config-module class loaded so far; returns how many
    classes are registered in all. Cheap and idempotent (a pass over ``sys.modules``)."""
    if ConfigModule is None:
        return 0
    for module in list(sys.modules.values()):
        kind = type(module)  # type(), not isinstance: a lazily loaded module must not be loaded by the check
        if kind not in _registered and issubclass(kind, ConfigModule):
            copyreg.pickle(kind, reduce_config_module)
            _registered.add(kind)
    return len(_registered)


def reduce_config_module(module):
    """Pickle a config module by its name: unpickling imports it (``torch.distributed.config`` is a module)."""
    return importlib.import_module, (module.__name__,)
