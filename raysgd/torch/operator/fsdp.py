"""FSDP2 as a strategy: shard one rank's registered models with ``fully_shard`` on an explicit 1-D device mesh.

Layer 1 (torch and layer 1's ``compiled``; ``torch.distributed.fsdp`` is imported where it is used, so a torch
without it imports this module). ``TorchTrainer(strategy="fsdp", fsdp_args=...)`` reaches here twice:

- before any actor starts, :func:`check_strategy` and :func:`check_fsdp_args` (pure checks, naming the argument,
  what was expected and what was given) refuse what cannot work: a torch older than :data:`MIN_TORCH`, apex,
  ``wrap_ddp=False``, GPUs without nccl, unknown or ill-typed ``fsdp_args``, a CPU offload on a CPU run;
- in every worker, :class:`Sharding` (held by the operator, as :class:`~raysgd.torch.operator.precision.Precision`
  is) shards what ``register()`` got: every submodule the policy picks, then the root, on
  ``init_device_mesh(device type, (world size,))`` (gloo on CPU, nccl on GPU; never the mesh ``fully_shard``
  would pick, which prefers an accelerator), with ``use_fp16`` mapped to a ``MixedPrecisionPolicy``, and points
  the user's optimizers at the sharded parameters (they were made before the sharding).

:class:`ShardingHelpers` is the operator's face of it: ``strategy``, ``full_models()`` (the whole models on CPU,
a collective) and ``unsharded()`` (validation without a collective per batch).

What the choices are and why:

- **One worker trains unsharded.** There is nothing to shard over; the models stay plain (``strategy`` is then
  ``"ddp"``, as for any replicated model), so the state, ``save``/``load`` and restarts work as they do for DDP.
- **Micro-batches reduce-scatter every time.** ``set_requires_gradient_sync(False)`` would hold an unsharded fp32
  gradient of every parameter between micro-batches (the memory FSDP exists to save), and a partial optimizer
  step at the end of an epoch would leave its gradients inside FSDP, where no public call reduces them. The sharded
  gradients add up to the same sums (up to rounding), and the partial step is only rescaled.
- **Validation stays sharded.** Every FSDP forward all-gathers; exact validation shards can differ by a batch, and a
  rank with one forward more would wait in its all-gather forever. The ranks validate in lockstep, a rank that ran
  out padding with its last batch (:mod:`raysgd.torch.operator.fsdp_validation`): no rank holds more than sharded
  training does. ``fsdp_args={"validation": "gathered"}`` instead gathers each model once on every rank when
  validation starts and keeps the parameters whole until it ends (:meth:`Sharding.unsharded`).
- **Buffers are rank 0's**, as DDP keeps them (:mod:`raysgd.torch.operator.fsdp_buffers`).
- **fp16.** A ``torch.amp.GradScaler`` works on FSDP2's DTensor gradients (checked on CPU/gloo with an enabled
  scaler: an inf in one rank's shard skips the step on every rank), so ``use_fp16=True`` means what it means
  for DDP: float16 (``MixedPrecisionPolicy(param_dtype=float16, reduce_dtype=float32)``) and the scaler on CUDA,
  fp32 on CPU. ``"bf16"`` maps to ``param_dtype=bfloat16, reduce_dtype=float32`` on both. Under any policy
  with a ``param_dtype``, a BatchNorm layer (one with running statistics) gets its own ``fully_shard`` with float32
  parameters (:func:`keeps_float32`), as FSDP1's ``MixedPrecision`` and autocast keep it.

Example:
    >>> check_strategy("ddp"), check_fsdp_args(None, "ddp")
    ('ddp', {})
    >>> check_strategy("zero3")
    Traceback (most recent call last):
    ValueError: TorchTrainer: strategy expects 'ddp' or 'fsdp'; got 'zero3'
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    >>> [name for name, _ in blocks(model, None)]  # the default policy: a Sequential's blocks with parameters
    ['2', '0']
    >>> meta_skeleton(model)[0].weight.device.type, model[0].weight.device.type
    ('meta', 'cpu')
"""
import collections
import contextlib
import copy
import dataclasses
import itertools
import logging
from typing import Any, Callable

import torch

from raysgd.base.checks import expect
from raysgd.torch.operator import compiled as _compiled
from raysgd.torch.operator.fsdp_buffers import BufferSync
from raysgd.torch.operator.fsdp_validation import VALIDATION_MODES, LockstepBatches

logger = logging.getLogger(__name__)

#: ``TorchTrainer(strategy=...)``: replicate (DistributedDataParallel) or shard (FSDP2's ``fully_shard``).
STRATEGIES = ("ddp", "fsdp")
#: The oldest torch accepted, the oldest tested: tests/cluster/operator/test_fsdp.py,
#: tests/cluster/state/test_fsdp_state.py and tests/unit/state/test_sharded_state.py pass on 2.9.0 and 2.13.0 (CPU,
#: gloo; see the README). ``fully_shard`` is public from 2.6, but on a gloo mesh 2.7.0 and 2.8.0 reduce gradients
#: to twice their mean (measured: an SGD step differs from one process; Adam hides most of it).
MIN_TORCH = "2.9"
#: The keys ``fsdp_args`` may hold (see :func:`check_fsdp_args`).
FSDP_ARGS = ("reshard_after_forward", "mp_policy", "offload_policy", "shard_policy", "validation")
_warned_one_worker = False


def check_strategy(strategy, *, use_fp16=False, wrap_ddp=True, use_gpu=False, backend="gloo",
                   torch_version=None, caller="TorchTrainer"):
    """``strategy`` checked with what it needs (before any actor starts); returns it.

    ``"fsdp"`` needs torch >= :data:`MIN_TORCH` with ``torch.distributed``, ``wrap_ddp=True`` (models are wrapped
    by the trainer), nccl with GPUs, and no apex.

    Example:
        >>> check_strategy("fsdp", torch_version="2.5.1")
        Traceback (most recent call last):
        ValueError: TorchTrainer: strategy='fsdp' expects torch >= 2.9 (FSDP2's fully_shard on a CPU mesh with gloo); got torch 2.5.1
        >>> check_strategy("fsdp", use_fp16="apex")
        Traceback (most recent call last):
        ValueError: TorchTrainer: use_fp16 expects False, True or 'bf16' with strategy='fsdp' (apex patches whole models, FSDP2 shards them); got 'apex'
    """
    expect(isinstance(strategy, str) and strategy in STRATEGIES, "strategy", "'ddp' or 'fsdp'", strategy,
           caller=caller)
    if strategy != "fsdp":
        return strategy
    version = torch.torch_version.TorchVersion(torch_version or torch.__version__)
    expect(version >= MIN_TORCH, "strategy='fsdp'", f"torch >= {MIN_TORCH} (FSDP2's fully_shard on a CPU mesh with "
           "gloo)", version, caller=caller, got=f"torch {version}")
    expect(torch.distributed.is_available(), "strategy='fsdp'", "a torch built with torch.distributed", version,
           caller=caller, got=f"torch {torch.__version__}, built without it")
    expect(use_fp16 != "apex", "use_fp16", "False, True or 'bf16' with strategy='fsdp' (apex patches whole "
           "models, FSDP2 shards them)", use_fp16, caller=caller)
    expect(wrap_ddp is True, "wrap_ddp", "True (its default) with strategy='fsdp' (raysgd shards the registered "
           "models; wrap_ddp=False would leave them unsynchronised)", wrap_ddp, caller=caller)
    expect(not use_gpu or backend == "nccl", "backend", "'nccl' with strategy='fsdp' on GPUs (FSDP2's "
           "collectives on CUDA tensors; whole GPUs per worker)", backend, caller=caller)
    return strategy


def check_fsdp_args(fsdp_args, strategy, *, use_fp16=False, use_gpu=False, caller="TorchTrainer"):
    """``fsdp_args`` (a dict of :data:`FSDP_ARGS` keys, or None) checked; returns it as a dict.

    ``reshard_after_forward``: True, False or None (FSDP2's default: True, the root False);
    ``mp_policy``: a ``MixedPrecisionPolicy``, only with ``use_fp16=False`` (``use_fp16`` already picks one);
    ``offload_policy``: an ``OffloadPolicy`` (a ``CPUOffloadPolicy`` only with GPUs); ``shard_policy``: which
    submodules get their own ``fully_shard`` before the root, as ``policy(module) -> bool`` or a module class (or
    tuple of them); default: the blocks of every ``nn.Sequential`` and ``nn.ModuleList`` (see :func:`blocks`);
    ``validation``: ``"sharded"`` (the default: the models stay sharded, the ranks validate in lockstep, see
    :mod:`raysgd.torch.operator.fsdp_validation`) or ``"gathered"`` (each model gathered whole on every rank while
    it validates).

    Example:
        >>> check_fsdp_args({"reshard_after_forward": False}, "fsdp")
        {'reshard_after_forward': False}
        >>> check_fsdp_args({"reshard": True}, "fsdp")
        Traceback (most recent call last):
        ValueError: TorchTrainer: fsdp_args expects keys among 'reshard_after_forward', 'mp_policy', 'offload_policy', 'shard_policy', 'validation'; got 'reshard'
        >>> check_fsdp_args({"reshard_after_forward": 2}, "fsdp")
        Traceback (most recent call last):
        TypeError: TorchTrainer: fsdp_args['reshard_after_forward'] expects True, False or None; got 2
    """
    expect(fsdp_args is None or isinstance(fsdp_args, dict), "fsdp_args", "a dict or None", fsdp_args, TypeError,
           caller)
    if not fsdp_args:
        return {}
    expect(strategy == "fsdp", "fsdp_args", "None with strategy='ddp' (pass strategy='fsdp')", fsdp_args,
           caller=caller)
    for key in fsdp_args:
        expect(key in FSDP_ARGS, "fsdp_args", "keys among " + ", ".join(map(repr, FSDP_ARGS)), key, caller=caller)
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy  # noqa: PLC0415

    reshard = fsdp_args.get("reshard_after_forward")
    expect(reshard is None or isinstance(reshard, bool), "fsdp_args['reshard_after_forward']",
           "True, False or None", reshard, TypeError, caller)
    mp_policy = fsdp_args.get("mp_policy")
    if mp_policy is not None:
        expect(isinstance(mp_policy, MixedPrecisionPolicy), "fsdp_args['mp_policy']",
               "a torch.distributed.fsdp.MixedPrecisionPolicy", mp_policy, TypeError, caller)
        expect(not use_fp16, "use_fp16", "False with fsdp_args['mp_policy'] (use_fp16 picks the policy itself: "
               "give one or the other)", use_fp16, caller=caller)
    offload = fsdp_args.get("offload_policy")
    if offload is not None:
        expect(isinstance(offload, OffloadPolicy), "fsdp_args['offload_policy']",
               "a torch.distributed.fsdp.OffloadPolicy (e.g. CPUOffloadPolicy())", offload, TypeError, caller)
        expect(use_gpu or not isinstance(offload, CPUOffloadPolicy), "fsdp_args['offload_policy']",
               "no CPUOffloadPolicy when the workers train on CPU (nothing to offload; FSDP2 then looks for an "
               "accelerator)", offload, caller=caller)
    validation = fsdp_args.get("validation")
    expect(validation is None or validation in VALIDATION_MODES, "fsdp_args['validation']",
           " or ".join(map(repr, VALIDATION_MODES)), validation, caller=caller)
    policy = fsdp_args.get("shard_policy")
    if policy is not None:
        classes = policy if isinstance(policy, tuple) else (policy,)
        is_classes = all(isinstance(c, type) and issubclass(c, torch.nn.Module) for c in classes)
        expect(is_classes or (callable(policy) and not isinstance(policy, type)), "fsdp_args['shard_policy']",
               "a function module -> bool, or an nn.Module subclass (or a tuple of them)", policy, TypeError, caller)
    return dict(fsdp_args)


def blocks(model, policy):
    """``[(name, module)]`` that get their own ``fully_shard`` before the root, deepest first (FSDP2 shards
    bottom-up). ``policy``: see :func:`check_fsdp_args`; None picks every child of an ``nn.Sequential`` or
    ``nn.ModuleList`` that holds parameters (a model's repeated blocks). The root and modules without parameters
    are never picked; containers without ``forward`` (``ModuleList``, ``ModuleDict``) neither; nor a module that
    shares a parameter with the rest of the model (tied weights, :func:`shares_outside`): FSDP2 manages a parameter
    in one group, and an enclosing one (at last the root) holds it.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 1)))
        >>> [name for name, _ in blocks(model, None)], [name for name, _ in blocks(model, torch.nn.Linear)]
        (['1.0', '1', '0'], ['1.0', '0'])
        >>> model[1][0].weight = torch.nn.Parameter(torch.ones(2, 2))
        >>> model[0].weight = model[1][0].weight  # tied: both stay with the root
        >>> [name for name, _ in blocks(model, None)]
        []
    """
    if policy is None:
        containers = (torch.nn.Sequential, torch.nn.ModuleList)
        parents = {id(m) for m in model.modules() if isinstance(m, containers)}
        picked = {id(child) for m in model.modules() if id(m) in parents for child in m.children()}
        chosen = lambda m: id(m) in picked  # noqa: E731
    elif isinstance(policy, (type, tuple)):
        chosen = lambda m: isinstance(m, policy)  # noqa: E731
    else:
        chosen = policy
    chosen_modules = [(name, module) for name, module in reversed(list(model.named_modules()))
                      if module is not model and not isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict))
                      and next(module.parameters(), None) is not None and chosen(module)]
    tied = [name for name, module in chosen_modules if shares_outside(module, model)]
    if tied:
        logger.info("fsdp: %s share%s a parameter with the rest of the model (tied weights, or a module used "
                    "twice): sharded with an enclosing module, not on their own", ", ".join(tied),
                    "s" if len(tied) == 1 else "")
    return [(name, module) for name, module in chosen_modules if name not in tied]


def shares_outside(module, model):
    """Whether one of ``module``'s parameters is also one of ``model``'s outside ``module`` (tied weights: an
    embedding and an output layer holding one tensor), which FSDP2 refuses to shard in two groups.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        >>> shares_outside(model[0], model)
        False
        >>> model[1].weight = model[0].weight
        >>> shares_outside(model[0], model), shares_outside(model[1], model)
        (True, True)
    """
    everywhere = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    inside = collections.Counter(id(p) for _, p in module.named_parameters(remove_duplicate=False))
    return any(count < everywhere[key] for key, count in inside.items())


def keeps_float32(module, mp_policy):
    """Whether ``module`` is sharded on its own with float32 parameters under ``mp_policy``: a normalisation layer
    with running statistics (BatchNorm, an InstanceNorm that tracks them) whose parameters the policy would cast to
    a lower ``param_dtype``. Its float32 running statistics and lower-precision weights fail in ``batch_norm``
    (``expected scalar type BFloat16 but found Float``); float32 weights take a bfloat16 or float16 input, as under
    autocast with DDP and as FSDP1's ``MixedPrecision`` keeps them (``_module_classes_to_ignore``).

    Example:
        >>> from torch.distributed.fsdp import MixedPrecisionPolicy
        >>> bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        >>> keeps_float32(torch.nn.BatchNorm1d(3), bf16), keeps_float32(torch.nn.LayerNorm(3), bf16)
        (True, False)
        >>> keeps_float32(torch.nn.BatchNorm1d(3), MixedPrecisionPolicy())  # nothing cast: nothing to keep
        False
    """
    norm = isinstance(module, torch.nn.modules.batchnorm._NormBase)  # BatchNorm*d, SyncBatchNorm, InstanceNorm*d
    return (mp_policy.param_dtype is not None and norm and module.track_running_stats
            and next(module.parameters(recurse=False), None) is not None)


def _with_policy(options, module):
    """``fully_shard``'s ``options`` for ``module``: float32 parameters where :func:`keeps_float32` says so."""
    policy = options["mp_policy"]
    if not keeps_float32(module, policy):
        return options
    return {**options, "mp_policy": dataclasses.replace(policy, param_dtype=None, output_dtype=None)}


def meta_skeleton(module, device="meta"):
    """A deep copy of ``module`` whose parameters and buffers are on the meta device (no memory, no data copied):
    what :meth:`Sharding.gather` fills with the gathered state to give back a plain module of the user's class.
    ``device``: empty tensors there instead (the skeleton made real, ``skeleton`` given). Tied parameters stay tied
    (one tensor), which ``to_empty`` would untie.

    Example:
        >>> skeleton = meta_skeleton(torch.nn.Linear(3, 2))
        >>> skeleton.weight.shape, skeleton.weight.is_meta, type(skeleton).__name__
        (torch.Size([2, 3]), True, 'Linear')
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        >>> model[1].weight = model[0].weight
        >>> real = meta_skeleton(meta_skeleton(model), device="cpu")
        >>> real[0].weight.device.type, real[0].weight is real[1].weight
        ('cpu', True)
    """
    memo = {}
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if id(tensor) not in memo:
            empty = torch.empty_like(tensor.detach(), device=device)
            memo[id(tensor)] = torch.nn.Parameter(empty, tensor.requires_grad) \
                if isinstance(tensor, torch.nn.Parameter) else empty
    return copy.deepcopy(module, memo)


class Sharding:
    """Shards one rank's registered models (see the module docstring); inactive (every method a no-op) for
    ``strategy="ddp"`` and with one worker.

    Args:
        strategy: ``"ddp"`` or ``"fsdp"``; ``fsdp_args``: checked by :func:`check_fsdp_args`.
        precision: the operator's :class:`~raysgd.torch.operator.precision.Precision` (its ``autocast_dtype``
            picks the ``MixedPrecisionPolicy``); ``device``: the worker's; ``world_size``: the group's.

    Example:
        >>> from raysgd.torch.operator.precision import Precision
        >>> sharding = Sharding("fsdp", precision=Precision("bf16"), world_size=2)  # nothing sharded yet
        >>> sharding.active, sharding.policy().param_dtype, sharding.policy().reduce_dtype
        (True, torch.bfloat16, torch.float32)
        >>> model = torch.nn.Linear(1, 1)
        >>> Sharding("ddp", world_size=2).shard([model], [])[0] is model  # inactive: as given
        True
    """

    def __init__(self, strategy="ddp", fsdp_args=None, precision=None, device=None, world_size=1):
        global _warned_one_worker
        self.requested = strategy
        self.active = strategy == "fsdp" and world_size > 1
        self._args = dict(fsdp_args or {})
        self._dtype = precision.autocast_dtype if precision is not None else None
        self._device = torch.device(device) if device is not None else torch.device("cpu")
        self._world_size = world_size
        self._mesh = None
        self._sharded = []  # (root, skeleton) of every sharded model
        self._buffers = []  # a BufferSync per sharded model: rank 0's buffers on every rank, as DDP keeps them
        if strategy == "fsdp" and world_size == 1 and not _warned_one_worker:
            _warned_one_worker = True
            logger.info("strategy='fsdp' with one worker: nothing to shard over, the models train unsharded")

    @property
    def mesh(self):
        """The 1-D device mesh of the group's ranks (made at first use, on the worker's device type)."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

            self._mesh = init_device_mesh(self._device.type, (self._world_size,))
        return self._mesh

    def policy(self):
        """The ``MixedPrecisionPolicy`` the models are sharded with (``fsdp_args['mp_policy']`` or ``use_fp16``'s)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy  # noqa: PLC0415

        given = self._args.get("mp_policy")
        if given is not None:
            return given
        return MixedPrecisionPolicy(param_dtype=self._dtype, reduce_dtype=torch.float32 if self._dtype else None)

    def shard(self, models, optimizers, ddp_args=None):
        """Shard ``models`` in place (a ``torch.compile``'d one: the module inside, so it compiles the sharded
        module) and point ``optimizers`` at the sharded parameters; returns ``models``.

        The optimizers must be fresh: state made for whole parameters cannot follow them into shards. ``ddp_args``
        (``register``'s) must be empty: nothing is DDP-wrapped."""
        if not self.active:
            return models
        expect(not ddp_args, "register(ddp_args=...)", "None under strategy='fsdp' (use TorchTrainer(fsdp_args=...))",
               ddp_args, caller="TrainingOperator")
        from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

        for optimizer in optimizers:
            expect(not optimizer.state, "register(optimizers=...)", "optimizers without state under "
                   "strategy='fsdp' (made, not yet stepped or loaded: the state is sharded with the parameters)",
                   f"{type(optimizer).__name__} holding state for {len(optimizer.state)} parameters",
                   caller="TrainingOperator")
        given = self._args.get("reshard_after_forward")
        options = dict(mesh=self.mesh, mp_policy=self.policy())
        if self._args.get("offload_policy") is not None:
            options["offload_policy"] = self._args["offload_policy"]
        sharded = {}
        for model in models:
            root = _compiled.original(model)
            skeleton = meta_skeleton(root)
            before = {id(p): name for name, p in root.named_parameters(remove_duplicate=False)}
            # None means FSDP2's own default, spelt out (older fully_shard takes no None): blocks free their
            # gathered parameters after their forward, the root keeps them (its backward needs them at once)
            picked = {id(block) for _, block in blocks(root, self._args.get("shard_policy"))}
            for _, module in reversed(list(root.named_modules())):  # deepest first, as blocks() orders them
                if module is not root and (id(module) in picked or keeps_float32(module, options["mp_policy"])
                                           and not shares_outside(module, root)):
                    fully_shard(module, reshard_after_forward=True if given is None else given,
                                **_with_policy(options, module))
            fully_shard(root, reshard_after_forward=False if given is None else given, **_with_policy(options, root))
            after = dict(root.named_parameters(remove_duplicate=False))
            sharded.update({key: after[name] for key, name in before.items()})
            self._sharded.append((root, skeleton))
            self._buffers.append(BufferSync(root, self.mesh.get_group()))
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["params"][:] = [sharded.get(id(p), p) for p in group["params"]]  # in place: cached lists too
        return models

    def sync_buffers(self):
        """Rank 0's buffers to every rank, now (a collective: every rank calls it; a no-op when nothing is sharded):
        before any state is read (see :mod:`raysgd.torch.operator.fsdp_buffers`)."""
        for buffers in self._buffers:
            buffers.sync()

    def gather(self, models):
        """The whole ``models`` on CPU as plain modules of their own classes, on rank 0 (None elsewhere): a
        collective, every rank must call it. Unsharded models are copied to CPU from their tensors; the buffers
        are rank 0's (every rank's, after :meth:`sync_buffers`)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # noqa: PLC0415

        self.sync_buffers()
        skeletons = {id(root): skeleton for root, skeleton in self._sharded}
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        copies: list[torch.nn.Module | None] = []
        for model in models:
            skeleton = skeletons.get(id(model))
            state = get_model_state_dict(model, options=options) if skeleton is not None else model.state_dict()
            if skeleton is None:
                skeleton = meta_skeleton(model)
            elif torch.distributed.get_rank() != 0:
                copies.append(None)
                continue
            plain = meta_skeleton(skeleton, device="cpu")  # (tied parameters stay one tensor)
            plain.load_state_dict(state)
            for name, buffer in model.named_buffers():  # non-persistent buffers are in no state dict
                if name not in state and buffer is not None:
                    owner, _, leaf = name.rpartition(".")
                    setattr(plain.get_submodule(owner), leaf, buffer.detach().to("cpu", copy=True))
            copies.append(plain.train(model.training))
        return None if any(c is None for c in copies) else copies

    @contextlib.contextmanager
    def validating(self, batches, pad):
        """Context around a validation call: yields the batches the operator's ``validate`` loop gets. Sharded
        models stay sharded (every rank takes rank 0's buffers first, no broadcast per forward) and the batches come
        in lockstep (:class:`~raysgd.torch.operator.fsdp_validation.LockstepBatches`, ``pad(batch)`` running a
        padding batch); with ``fsdp_args={"validation": "gathered"}`` the models are gathered whole for the call
        (:meth:`unsharded`). Nothing sharded: the batches as they are."""
        if not self._sharded:
            yield batches
            return
        if self._args.get("validation") == "gathered":
            with self.unsharded():
                yield batches
            return
        self.sync_buffers()  # every rank validates with rank 0's buffers (those get_model() and a checkpoint hold)
        try:
            for buffers in self._buffers:
                buffers.quiet(True)  # padding forwards run no grad-mode forward either; nothing to broadcast
            yield LockstepBatches(batches, pad, self.mesh.get_group())
        finally:
            for buffers in self._buffers:
                buffers.quiet(False)

    @contextlib.contextmanager
    def unsharded(self):
        """Every sharded model whole on this rank until exit (an all-gather on entry, every rank must enter):
        forwards inside run without collectives, so ranks with different batch counts never wait for each other."""
        if not self._sharded:
            yield
            return
        from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415

        given = self._args.get("reshard_after_forward")
        modules = [(root, m) for root, _ in self._sharded for m in root.modules() if isinstance(m, FSDPModule)]
        self.sync_buffers()  # every rank validates with rank 0's buffers (those get_model() and a checkpoint hold)
        try:
            for buffers in self._buffers:
                buffers.quiet(True)  # no broadcast per forward: the ranks' batch counts may differ
            for _, module in modules:
                module.set_reshard_after_forward(False, recurse=False)
                module.unshard()
            yield
        finally:
            for buffers in self._buffers:
                buffers.quiet(False)
            for root, module in modules:  # back to what fully_shard got (None: True, the root False)
                module.set_reshard_after_forward(given if given is not None else module is not root, recurse=False)
                module.reshard()


class ShardingHelpers:
    """The operator's side of :class:`Sharding` (``self._sharding``, set by the operator): ``strategy``,
    ``shards_state``, ``full_models()`` and ``unsharded()``.

    Example:
        >>> class Op(ShardingHelpers):
        ...     _sharding = Sharding("fsdp", world_size=1)
        ...     def registered_models(self):
        ...         return [torch.nn.Linear(1, 1)]
        >>> op = Op()
        >>> op.strategy, type(op.full_models()[0]).__name__
        ('ddp', 'Linear')
    """

    # provided by the host class (TrainingOperator)
    _sharding: Sharding
    registered_models: Callable[[], list[torch.nn.Module]]
    validate_batch: Callable[..., Any]

    @property
    def strategy(self):
        """How this rank's registered models are spread over the workers: ``"fsdp"`` when they are sharded by FSDP2's
        ``fully_shard`` (parameters, gradients and optimizer state are this rank's shards, as DTensors), else
        ``"ddp"`` (whole on every rank: DDP-wrapped, or plain with one worker, also under ``strategy="fsdp"``)."""
        return "fsdp" if self._sharding.active else "ddp"

    @property
    def shards_state(self):
        """Whether this rank's state is kept as its part of a sharded (DCP) state: under ``strategy="fsdp"`` at any
        number of workers, one included, so a state moves between sizes (1 <-> N) in one format."""
        return self._sharding.requested == "fsdp"

    def full_models(self):
        """The registered models whole, on CPU, as plain modules of their own classes (no DDP, FSDP or compile
        wrapper), on rank 0; None on the other ranks of a sharded group. Sharded, it is a collective: every rank
        calls it (``TorchTrainer.get_model()`` does)."""
        return self._sharding.gather(self.registered_models())

    def unsharded(self):
        """Context: the sharded models whole on this rank until exit (a collective on entry; see
        :meth:`Sharding.unsharded`); a no-op unless ``strategy == "fsdp"``. Validation runs inside it with
        ``fsdp_args={"validation": "gathered"}``."""
        return self._sharding.unsharded()

    def validating(self, batches, info=None):
        """Context: yields the batches a validation call's ``validate`` loop gets (see :meth:`Sharding.validating`):
        under ``strategy="fsdp"`` in lockstep over the ranks, a rank that has run out padding with its last batch
        through :meth:`validate_batch` (``batch_info["padding"] = True``, its result dropped); else as they are."""
        info = dict(info or {})

        def pad(batch):
            with torch.no_grad():
                self.validate_batch(batch, {**info, "batch_idx": -1, "padding": True})

        return self._sharding.validating(batches, pad)

    def sync_buffers(self):
        """Rank 0's buffers to every rank of a sharded group (a collective; a no-op unless ``strategy == "fsdp"``):
        the state reads it before anything is saved (see :mod:`raysgd.torch.operator.fsdp_buffers`)."""
        self._sharding.sync_buffers()
