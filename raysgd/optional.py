"""Optional dependencies: import one when a feature needs it, or raise an ImportError naming the extra to install.

Layer 0: the standard library only. This is the one home of the extra names: :data:`EXTRAS` says which
``pip install "raysgd[...]"`` extra brings each optional module (``tests/repo/test_repository.py`` checks it
against ``setup.py``). ``import raysgd`` and a plain training run need none of them; a module that uses
one imports it through :func:`require` (inside the function that needs it) or :func:`lazy` (a module-level
name that imports on first use), so a missing package fails only the feature that needs it, with a
:class:`MissingExtra` that says what to install.

Example:
    >>> install_hint("pyarrow")
    'pip install "raysgd[storage]"'
    >>> require("json", "reading JSON").__name__  # not optional: imported as usual
    'json'
    >>> require("no_such_module_here", "the frobnicator")
    Traceback (most recent call last):
    ...
    raysgd.optional.MissingExtra: the frobnicator needs no_such_module_here, which is not importable here: pip install ...
"""
import importlib

#: Optional module (import name, or an executable for py-spy) -> (the raysgd extra that installs it, its pip name).
EXTRAS = {
    "pyarrow": ("storage", "pyarrow"),
    "tqdm": ("tqdm", "tqdm"),
    "tensorboardX": ("logging", "tensorboardX"),
    "matplotlib": ("logging", "matplotlib"),
    "pytorch_lightning": ("lightning", "pytorch-lightning"),
    "ray.tune": ("tune", "ray[tune]"),
    "ray.data": ("data", "ray[data]"),
    "sklearn": ("examples", "scikit-learn"),
    "py-spy": ("diagnostics", "py-spy"),
    "mlflow": ("mlflow", "mlflow"),
    "wandb": ("wandb", "wandb"),
    "safetensors": ("export", "safetensors"),  # raysgd export
    "prometheus_client": ("metrics", "ray[default]"),  # with it, Ray's node agent exports ray.util.metrics
}


class MissingExtra(ImportError):
    """An optional module a feature needs is not importable; the message names the extra to install.

    ``extra`` is the raysgd extra (``"storage"``), ``name`` the module that is missing.

    Example:
        >>> err = MissingExtra("x needs pyarrow", name="pyarrow", extra="storage")
        >>> isinstance(err, ImportError), err.extra
        (True, 'storage')
    """

    def __init__(self, message, *, name=None, extra=None):
        super().__init__(message, name=name)
        self.extra = extra


def _entry(name):
    """The :data:`EXTRAS` entry of ``name`` or of its top-level package (``pyarrow.fs`` -> ``pyarrow``)."""
    return EXTRAS.get(name) or EXTRAS.get(name.split(".")[0])


def extra_of(name):
    """The raysgd extra that installs module ``name`` (or its top-level package), else None.

    Example:
        >>> extra_of("pyarrow.fs"), extra_of("ray.tune"), extra_of("foo")
        ('storage', 'tune', None)
    """
    entry = _entry(name)
    return entry[0] if entry else None


def install_hint(name, extra=None):
    """The pip command that makes ``name`` importable: ``extra``, else the raysgd extra that brings it.

    Example:
        >>> install_hint("ray.tune"), install_hint("pyarrow.fs"), install_hint("foo")
        ('pip install "raysgd[tune]"', 'pip install "raysgd[storage]"', 'pip install foo')
        >>> install_hint("sklearn", extra="examples")
        'pip install "raysgd[examples]"'
    """
    extra = extra or extra_of(name)
    return f'pip install "raysgd[{extra}]"' if extra else f"pip install {name.split('.')[0]}"


def missing(name, feature, cause=None, extra=None):
    """The :class:`MissingExtra` saying that ``feature`` needs ``name`` and how to install it (for ``raise``).

    ``extra`` names the extra to install when it is not the one :data:`EXTRAS` gives for ``name`` (an
    example script that needs several packages names the ``examples`` extra, which brings them all).

    Example:
        >>> str(missing("tqdm", "TorchTrainer(use_tqdm=True)"))
        'TorchTrainer(use_tqdm=True) needs tqdm, which is not importable here: pip install "raysgd[tqdm]"'
    """
    entry = _entry(name)
    package = entry[1] if entry else name
    reason = ""
    if cause is not None and not (isinstance(cause, ModuleNotFoundError) and cause.name
                                  and name.startswith(cause.name)):
        reason = f" ({type(cause).__name__}: {cause})"  # installed but broken: say why, not only what
    extra = extra or extra_of(name)
    text = f"{feature} needs {package}, which is not importable here{reason}: {install_hint(name, extra)}"
    return MissingExtra(text, name=name, extra=extra)


def require(name, feature, extra=None):
    """Import module ``name`` (dotted names work) for ``feature``, or raise :class:`MissingExtra` from the cause.

    Example:
        >>> require("os.path", "joining paths").join("a", "b")
        'a/b'
    """
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise missing(name, feature, err, extra) from err


def available(name):
    """Whether module ``name`` can be imported (it is imported to find out).

    Example:
        >>> available("json"), available("no_such_module_here")
        (True, False)
    """
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


class LazyModule:
    """A module-level stand-in for an optional module, imported through :func:`require` on first attribute use.

    Example:
        >>> json = lazy("json", "reading JSON")
        >>> json.dumps([1])
        '[1]'
    """

    def __init__(self, name, feature):
        self._name, self._feature, self._module = name, feature, None

    def __getattr__(self, attribute):
        if attribute.startswith("__") or attribute in ("_name", "_feature", "_module"):
            raise AttributeError(attribute)  # copy, pickle and doctest probes never trigger an import
        if self._module is None:
            self._module = require(self._name, self._feature)
        return getattr(self._module, attribute)

    def __repr__(self):
        state = "imported" if self._module is not None else "not imported yet"
        return f"<lazy module {self._name!r} ({state})>"


def lazy(name, feature):
    """A :class:`LazyModule` for ``name``: ``pafs = lazy("pyarrow.fs", "storage_path")`` at a module's top.

    Example:
        >>> lazy("pyarrow.fs", "storage_path")
        <lazy module 'pyarrow.fs' (not imported yet)>
    """
    return LazyModule(name, feature)
