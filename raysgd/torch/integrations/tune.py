"""Ray Tune glue: ``BaseTorchTrainable`` and the ``Trainable`` class that ``TorchTrainer.as_trainable`` builds.

Layer 6: the only module that imports ``ray.tune``. It is itself imported lazily (by
``TorchTrainer.as_trainable`` and ``raysgd.torch.BaseTorchTrainable``), so ``import raysgd`` works
without ``ray[tune]``.

How a trial runs: Tune reserves one placement group per trial from
:meth:`default_resource_request` (bundle 0 for the trainable itself, then one bundle per worker;
with ``use_local`` rank 0 *is* the trainable, in bundle 0). The trainable actor runs inside that
group, and the trainer's worker group finds it (``get_current_placement_group``) and schedules rank
``r`` into bundle ``r + 1`` (``r`` with ``use_local``): a trial never creates a second, nested group.

Failures: ``step`` trains with ``max_retries=BaseTorchTrainable.max_retries`` (default 1). A worker
that dies is restarted inside the trial, in the trial's own bundles (freed when the dead group is
killed, so a restart never waits for or takes resources of other trials), from the state at the
start of the step. A failure beyond that fails the trial, and Tune restores it from its last
checkpoint when ``FailureConfig(max_failures=...)`` allows.

Example:
    >>> from ray import tune  # doctest: +SKIP
    >>> from raysgd.torch import TorchTrainer
    >>> Trainable = TorchTrainer.as_trainable(training_operator_cls=MyOperator, num_workers=2)  # doctest: +SKIP
    >>> tuner = tune.Tuner(Trainable, param_space={"lr": tune.grid_search([1e-3, 1e-2])},  # doctest: +SKIP
    ...                    run_config=tune.RunConfig(stop={"training_iteration": 2}))
    >>> tuner.fit().get_best_result(metric="val_loss", mode="min").config  # doctest: +SKIP
"""
import dataclasses
import inspect
import logging
import os
from typing import Any, Callable

from raysgd import optional
from raysgd.base.checks import expect
from raysgd.torch import options
from raysgd.torch.execution import cluster_state, shipping
from raysgd.torch.state import checkpoint

try:
    from ray.tune import PlacementGroupFactory, Trainable

    TUNE_INSTALLED = True
    _TUNE_IMPORT_ERROR = None
except ImportError as _err:  # Tune is optional: only as_trainable needs it
    Trainable, PlacementGroupFactory = object, None  # type: ignore[misc,assignment]  # stand-ins without Tune
    TUNE_INSTALLED = False
    _TUNE_IMPORT_ERROR = _err

logger = logging.getLogger(__name__)

#: The file a trial's checkpoint directory holds (the 1.x name).
CHECKPOINT_FILE = "trainer.checkpoint"
#: Its completion marker (the format of ``storage_path`` checkpoints, :mod:`raysgd.torch.storage.filesystem`).
MARKER_FILE = "checkpoint.json"
#: Keys that shape the resource request; read from the Tune config first, then from ``as_trainable``'s kwargs.
RESOURCE_KEYS = ("num_workers", "num_cpus_per_worker", "use_gpu", "use_local", "num_gpus_per_worker")


def merge_dicts(first, second):
    """A deep merge of two metric dicts: ``second`` wins, nested dicts are merged key by key.

    Example:
        >>> merge_dicts({"a": 1, "p": {"x": 1}}, {"a": 2, "p": {"y": 2}})
        {'a': 2, 'p': {'x': 1, 'y': 2}}
    """
    merged = dict(first)
    for key, value in second.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_dicts(merged[key], value)
        else:
            merged[key] = value
    return merged


def _gpus_available():
    """Whether ``use_gpu="auto"`` means GPUs: the Ray cluster has some (else this process sees CUDA)."""
    import ray  # noqa: PLC0415

    if ray.is_initialized():
        return ray.cluster_resources().get("GPU", 0) >= 1
    import torch  # noqa: PLC0415

    return torch.cuda.is_available()


def resolve_resources(tune_config, trainer_kwargs):
    """The :data:`RESOURCE_KEYS` of one trial, checked, ``"auto"`` resolved.

    Each value comes from the Tune config, else ``trainer_kwargs``, else TorchTrainer's default.

    Example:
        >>> resolve_resources({"num_workers": 3}, {"num_workers": 2, "use_gpu": False})
        {'num_workers': 3, 'num_cpus_per_worker': 1, 'use_gpu': False, 'use_local': False, 'num_gpus_per_worker': 1}
    """
    tune_config = tune_config or {}
    values = {key: tune_config.get(key, trainer_kwargs.get(key, options.TrainerOptions.default(key))) for key in RESOURCE_KEYS}
    options.check_resources(**values, caller="as_trainable")  # TorchTrainer's own checks
    use_gpu = values["use_gpu"]
    values["use_gpu"] = _gpus_available() if use_gpu == "auto" else use_gpu
    return values


def resource_bundles(resources):
    """The placement-group bundles of one trial: ``[{"CPU": 1}]`` (the trainable) + one per worker.

    With ``use_local`` the trainable process is rank 0, so the first worker bundle is its bundle.

    Example:
        >>> resource_bundles({"num_workers": 2, "num_cpus_per_worker": 2, "use_gpu": False, "use_local": False})
        [{'CPU': 1}, {'CPU': 2}, {'CPU': 2}]
        >>> resource_bundles({"num_workers": 2, "num_cpus_per_worker": 1, "use_gpu": True, "use_local": True,
        ...                   "num_gpus_per_worker": 0.5})
        [{'CPU': 1, 'GPU': 0.5}, {'CPU': 1, 'GPU': 0.5}]
    """
    worker = {"CPU": resources["num_cpus_per_worker"]}
    if resources["use_gpu"]:
        worker["GPU"] = resources.get("num_gpus_per_worker", 1)
    head = [] if resources["use_local"] else [{"CPU": 1}]
    return head + [dict(worker) for _ in range(options.worker_range(resources["num_workers"])[1])]


def _need(bundles, key):
    return sum(bundle.get(key, 0) for bundle in bundles)


def check_trial_fits(bundles, most, nodes=None):
    """Raise ``ValueError`` when a trial's ``bundles`` can never be placed, so it would stay PENDING forever.

    ``most``: the most CPUs and GPUs the cluster can ever have (:func:`raysgd.torch.execution.cluster_state.ceiling`;
    None, unknown: no check). ``nodes``: each node's CPUs and GPUs when the cluster cannot grow, else None:
    then every bundle must also fit on one node.

    Example:
        >>> check_trial_fits([{"CPU": 1}, {"CPU": 1}], {"CPU": 2, "GPU": 0}, [{"CPU": 2, "GPU": 0}])
        >>> check_trial_fits([{"CPU": 1}, {"CPU": 1}, {"CPU": 1}], {"CPU": 2, "GPU": 0})
        Traceback (most recent call last):
        ...
        ValueError: as_trainable: each trial asks for 3 CPUs and 0 GPUs (bundles [{'CPU': 1}, {'CPU': 1}, ...
    """
    asked = f"each trial asks for {_need(bundles, 'CPU'):g} CPUs and {_need(bundles, 'GPU'):g} GPUs (bundles " \
            f"{bundles}: 1 CPU for the trainable unless use_local, then one per worker)"
    advice = ("Ask for less (num_workers, num_cpus_per_worker, use_gpu or num_gpus_per_worker, in as_trainable's "
              "arguments or the Tune config), or start Ray with more (ray.init(num_cpus=...)) or add nodes.")
    if most is not None and any(_need(bundles, key) > most.get(key, 0) for key in ("CPU", "GPU")):
        raise ValueError(f"as_trainable: {asked}, but the cluster can have at most {most.get('CPU', 0):g} CPUs and "
                         f"{most.get('GPU', 0):g} GPUs, so the trial would wait forever. {advice}")
    for bundle in bundles if nodes is not None else ():
        if not any(all(bundle.get(key, 0) <= node.get(key, 0) for key in ("CPU", "GPU")) for node in nodes):
            raise ValueError(f"as_trainable: {asked}, but no node can hold the bundle {bundle} (the nodes have "
                             f"{nodes}), so the trial would wait forever. {advice}")


def cluster_limits():
    """``(most, nodes)`` for :func:`check_trial_fits`: ``(None, None)`` (no check) while Ray is not initialised."""
    import ray  # noqa: PLC0415

    if not ray.is_initialized():
        return None, None
    return cluster_state.ceiling(), cluster_state.fixed_nodes()


def trainer_kwargs_for(tune_config, trainer_kwargs):
    """The ``TorchTrainer`` kwargs of one trial; ``trainer_kwargs`` itself is never changed.

    The Tune config is merged into a copy of ``config`` (Tune wins). The resource keys found in the
    Tune config also replace the trainer's arguments, so the trainer starts exactly the workers the
    resource request reserved; ``use_gpu="auto"`` is resolved the way the request resolved it.

    Example:
        >>> kwargs = {"num_workers": 1, "config": {"lr": 0.1, "batch_size": 8}}
        >>> new = trainer_kwargs_for({"lr": 0.5, "num_workers": 2}, kwargs)
        >>> new["config"], new["num_workers"], kwargs["config"]["lr"]
        ({'lr': 0.5, 'batch_size': 8, 'num_workers': 2}, 2, 0.1)
    """
    tune_config = dict(tune_config or {})
    kwargs = dict(trainer_kwargs)
    kwargs["config"] = {**(trainer_kwargs.get("config") or {}), **tune_config}
    resources = resolve_resources(tune_config, trainer_kwargs)
    for key in RESOURCE_KEYS:
        if key in tune_config or key in trainer_kwargs or key == "use_gpu":
            kwargs[key] = resources[key]
    return kwargs


class BaseTorchTrainable(Trainable):
    """A Tune ``Trainable`` that trains a ``TorchTrainer``: one ``step`` is one ``train()`` plus one ``validate()``.

    Usually built by ``TorchTrainer.as_trainable(...)``. Subclass it directly by implementing
    :meth:`_create_trainer` (and :meth:`default_resource_request` to match the workers it starts).

    Attributes:
        max_retries: how often ``step`` restarts lost workers inside the trial before the trial fails
            and Tune's ``FailureConfig(max_failures=...)`` takes over (default 1; 0 as in RaySGD 1.12).

    Example:
        >>> class MyTrainable(BaseTorchTrainable):  # doctest: +SKIP
        ...     def _create_trainer(self, config):
        ...         return TorchTrainer(training_operator_cls=MyOperator, config=config)
    """

    max_retries = 1
    _train: Callable[..., Any]  # RaySGD 1.x's hook, if a subclass still defines it (step() refuses it)

    def setup(self, config):
        """Build the trainer from the Tune ``config``."""
        self._trainer = None
        self._trainer = self._create_trainer(config)

    def step(self):
        """``trainer.train()`` then ``trainer.validate()`` (both with ``profile=True``); returns their merged metrics."""
        if getattr(self, "_train", None) is not None and callable(self._train):
            raise DeprecationWarning("Trainable._train is deprecated: override step() (or pass override_tune_step "
                                     "to as_trainable) instead.")
        train_stats = self.trainer.train(max_retries=self.max_retries, profile=True)
        validation_stats = self.trainer.validate(max_retries=self.max_retries, profile=True)
        return merge_dicts(train_stats, validation_stats)

    def save_checkpoint(self, checkpoint_dir):
        """Write the trainer state into ``checkpoint_dir``; returns None (Ray 2.x's contract).

        The format is that of ``TorchTrainer(storage_path=...)`` checkpoints (:mod:`raysgd.torch.storage.filesystem`):
        ``trainer.checkpoint`` (the bytes :meth:`TorchTrainer.save` writes), then its ``checkpoint.json``
        marker with size and CRC-32, so a damaged trial checkpoint is detected when it is loaded.
        """
        from raysgd.torch.storage import filesystem as storage  # noqa: PLC0415 (pyarrow comes with ray[tune])

        filesystem, path = storage.resolve(checkpoint_dir)
        state = self.trainer.state_dict()
        storage.write_checkpoint_dir(filesystem, path, checkpoint.state_to_bytes(state),
                                     {"epoch": state["epoch"], "reason": "tune", "iteration": self.training_iteration})
        return None

    def load_checkpoint(self, checkpoint):
        """Restore the trainer from what :meth:`save_checkpoint` wrote: the directory (checked against its marker),
        or a 1.x ``trainer.checkpoint`` file or a directory holding one; loaded safely, as ``TorchTrainer.load``.
        Anything else raises :class:`~raysgd.torch.errors.CheckpointError` naming it."""
        if isinstance(checkpoint, dict):  # a state dict returned by an overridden save_checkpoint
            self.trainer.load_state_dict(checkpoint, blocking=True)
        else:
            self.trainer.load(os.fspath(checkpoint), blocking=True)

    def cleanup(self):
        """Shut the trainer (and its workers) down."""
        trainer = getattr(self, "_trainer", None)
        if trainer is not None:
            trainer.shutdown()
            self._trainer = None

    def _create_trainer(self, config):
        """Return the ``TorchTrainer`` of this trial (``config`` is the Tune config)."""
        raise NotImplementedError("BaseTorchTrainable subclasses must implement _create_trainer(config)")

    @property
    def trainer(self):
        """The trial's ``TorchTrainer``."""
        if getattr(self, "_trainer", None) is None:
            raise RuntimeError("This trainable has no trainer: setup() failed or cleanup() already ran.")
        return self._trainer


def checkpoint_state(path, weights_only=True):
    """The trainer state in a trial checkpoint: the directory :meth:`BaseTorchTrainable.save_checkpoint` wrote
    (``result.checkpoint.path``, what Tune hands ``load_checkpoint``; checked against its marker) or its
    ``trainer.checkpoint`` file; a safe load by default, as ``TorchTrainer.load``.

    Example:
        >>> state = checkpoint_state(result.checkpoint.path)  # doctest: +SKIP
        >>> state["epoch"]  # doctest: +SKIP
        2
    """
    from raysgd.torch.storage import filesystem as storage  # noqa: PLC0415 (pyarrow comes with ray[tune])

    loaded = storage.read_path(path, weights_only=weights_only)  # a directory's bytes, checked; a file's state
    return loaded if isinstance(loaded, dict) else checkpoint.state_from_bytes(loaded, weights_only=weights_only)


def _check_step_function(override_tune_step):
    if override_tune_step is None:
        return
    how = {"caller": "as_trainable", "call": True}
    expect(callable(override_tune_step), "override_tune_step", "a callable (trainer, info)", override_tune_step,
           TypeError, **how)
    try:
        params = inspect.signature(override_tune_step).parameters
    except (TypeError, ValueError) as err:
        raise ValueError(f"as_trainable(override_tune_step=...): cannot read the signature of "
                         f"{override_tune_step!r}") from err
    expect(len(params) == 2, "override_tune_step", "a function of exactly 2 parameters (trainer, info)",
           override_tune_step, got=f"{len(params)}: {list(params)}", **how)


#: TorchTrainer's options whose check reads no other option, and that no Tune config changes: checked by
#: ``as_trainable`` itself (the others, with a trial's config, when it starts).
FIXED_OPTIONS = ("training_operator_cls", "initialization_hook", "config", "placement_strategy", "timeout_s",
                 "callbacks")


def check_trainer_arguments(trainer_cls, args, kwargs):
    """Refuse, in ``as_trainable``, the arguments that every trial's ``trainer_cls(*args, **kwargs)`` would refuse
    when it starts (after Tune reserved its resources, once per trial and retry): arguments its signature cannot
    take (TorchTrainer's options are keywords), and for TorchTrainer's options an unknown or removed keyword and a
    bad :data:`FIXED_OPTIONS` value (no ``training_operator_cls``, say).

    Example:
        >>> check_trainer_arguments(lambda *, lr: None, (), {"lr": 0.1})
        >>> check_trainer_arguments(lambda *, lr: None, (0.1,), {})
        Traceback (most recent call last):
        ...
        TypeError: as_trainable: every trial would call <lambda>(...) with arguments it cannot take: too many ...
    """
    try:
        signature = inspect.signature(trainer_cls)
    except (TypeError, ValueError):  # no signature to read: the trial will tell
        return
    name = getattr(trainer_cls, "__name__", type(trainer_cls).__name__)
    try:
        signature.bind(*args, **kwargs)
    except TypeError as err:
        raise TypeError(f"as_trainable: every trial would call {name}(...) with arguments it cannot take: {err} "
                        f"(TorchTrainer's options are keywords: as_trainable(training_operator_cls=MyOperator, "
                        f"...))") from err
    if getattr(trainer_cls.__init__, "__signature__", None) != options.TrainerOptions.signature():
        return  # a trainer class with a constructor of its own
    known = {field.name for field in dataclasses.fields(options.TrainerOptions)}
    options.check_deprecated({key: value for key, value in kwargs.items() if key not in known})
    values = {key: kwargs.get(key, options.TrainerOptions.default(key)) for key in FIXED_OPTIONS}
    for key in FIXED_OPTIONS:
        options.TrainerOptions.field(key).metadata["check"](values, "as_trainable")


def make_trainable(trainer_cls, *args, override_tune_step=None, **kwargs):
    """The class behind ``TorchTrainer.as_trainable``: a :class:`BaseTorchTrainable` building ``trainer_cls(**kwargs)``.

    ``override_tune_step(trainer, {"iteration": n})``, when given, replaces :meth:`BaseTorchTrainable.step`;
    ``n`` is the number of steps completed before this one.

    Example:
        >>> Trainable = make_trainable(TorchTrainer, training_operator_cls=MyOperator)  # doctest: +SKIP
        >>> Trainable.default_resource_request({"num_workers": 2}).bundles  # doctest: +SKIP
        [{'CPU': 1.0}, {'CPU': 1.0}, {'CPU': 1.0}]
    """
    if not TUNE_INSTALLED:
        raise optional.missing("ray.tune", "TorchTrainer.as_trainable", _TUNE_IMPORT_ERROR) from _TUNE_IMPORT_ERROR
    _check_step_function(override_tune_step)
    expect(kwargs.get("storage_path") is None, "storage_path", "None under Tune (every trial would write to the "
           "same place); Tune keeps trial checkpoints itself (RunConfig(storage_path=...))", kwargs.get("storage_path"),
           caller="as_trainable")
    check_trainer_arguments(trainer_cls, args, kwargs)  # a bad argument fails here, not in every trial
    resolve_resources({}, kwargs)
    shipping.install()  # Tune pickles the trainable, with the operator class, in this process
    captured_args, captured_kwargs = tuple(args), dict(kwargs)

    class TorchTrainable(BaseTorchTrainable):
        _trainer_cls = trainer_cls
        _trainer_args = captured_args
        _trainer_kwargs = captured_kwargs
        _override_tune_step = staticmethod(override_tune_step) if override_tune_step else None

        @classmethod
        def default_resource_request(cls, config):
            """One placement group (strategy PACK): the trainable's bundle, then one bundle per worker.

            A request the cluster can never hold is a ``ValueError`` (:func:`check_trial_fits`), not a trial
            PENDING forever."""
            bundles = resource_bundles(resolve_resources(config, cls._trainer_kwargs))
            check_trial_fits(bundles, *cluster_limits())
            return PlacementGroupFactory(bundles, strategy="PACK")

        def _create_trainer(self, config):
            kwargs = trainer_kwargs_for(config, self._trainer_kwargs)
            logger.debug("Trial %s: TorchTrainer(%s)", self.trial_id, kwargs)
            return self._trainer_cls(*self._trainer_args, **kwargs)

        def step(self):
            if self._override_tune_step is None:
                return super().step()
            return self._override_tune_step(self.trainer, {"iteration": self.training_iteration})

    return TorchTrainable
