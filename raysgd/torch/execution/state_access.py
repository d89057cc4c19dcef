"""The run's training state as the facade reads and writes it, through the controller that owns the run.

Layer 5 (ray, layers 0-4). :class:`StateAccess` is the part of :class:`~raysgd.torch.execution.controller.RunController`
that moves the workers' state in and out: rank 0's state (``state_dict``, ``models``, ``full_models``), loads
(``load_stream``, ``load_path``, ``load_checkpoint``: checked, and made the restart point), ``save`` (atomic; a
sharded state written as a checkpoint directory of parts, each by a task on the node holding it) and the durable
run's checkpoints after a ``train()`` (``on_result``). State never passes through the driver unless the user asks
for it (``state_dict``, ``save(consolidated=True)``). It relies on the controller's ``group``, ``points``,
``durable``, ``commits``, ``ensure_workers``, ``run``, ``first_answer`` and ``take_snapshot``.

Example:
    >>> # controller.save("ckpt"); controller.load_path("ckpt"); controller.state_dict()["epoch"]
"""
from __future__ import annotations

import os

from raysgd.base import stateful
from raysgd.base.paths import is_uri
from raysgd.torch.errors import CheckpointError
from raysgd.torch.state import checkpoint
from raysgd.torch.restart_points.restart_point import RestartPoint, ShardedPoint
from raysgd.torch.storage import filesystem, parts
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from raysgd.torch.execution.restart_points import NoRestartPoints, RestartPoints
    from raysgd.torch.execution.worker_group import WorkerGroup


class StateAccess:
    """The controller's state methods (see the module docstring): a mixin of
    :class:`~raysgd.torch.execution.controller.RunController`, which holds what they use."""

    # What they use of the controller's state and methods (provided by the host class, RunController):
    group: WorkerGroup
    points: RestartPoints | NoRestartPoints
    durable: Any
    commits: Any
    components: dict[str, Any]
    _timeout_s: float
    ensure_workers: Callable[[], None]
    run: Callable[..., list]
    first_answer: Callable[..., Any]
    take_snapshot: Callable[[], Any]

    def on_result(self, phase, reduced):
        """A call's reduced result: checkpoint to ``storage_path`` when the durable run asks for it."""
        self.durable.on_result(phase, reduced, self._checkpoint_part, states=self.component_states)

    def component_states(self):
        """``{name: state_dict()}`` of the controller's driver-side ``components``, taken when called: the durable run
        calls it only when it writes a checkpoint, and keeps the answer in that checkpoint's marker."""
        return stateful.state_dicts(self.components)

    def _checkpoint_part(self):
        """The state file of a durable checkpoint of the current state (see :meth:`_part_of`)."""
        return self._part_of(self.take_snapshot())

    def _part_of(self, point):
        """The state file of a durable checkpoint of ``point``: written by a task on the node holding it
        (:class:`~raysgd.torch.storage.parts.RemotePart`), never through the driver."""
        storage = self.durable.storage
        if isinstance(point, ShardedPoint):  # a part per rank, each written on its node
            return parts.ShardedRemoteParts(point, storage.root, storage.local, timeout_s=self._timeout_s)
        return parts.RemotePart(point.refs, point.nodes[0], storage.root, storage.local, timeout_s=self._timeout_s,
                                overlay=point.overlay)

    def state_dict(self):
        """Rank 0's current state as a dict on CPU (always fresh: a custom validate or ``get_local_operator`` may
        have changed it)."""
        return checkpoint.state_from_bytes(self._fresh_stream())

    def _fresh_stream(self):
        """Rank 0's current state bytes, pulled into the driver (only where the user asks for the state); a sharded
        state is consolidated here into one state of whole tensors."""
        self.ensure_workers()
        self.points.stale = True
        return self._stream_of(self.take_snapshot())

    def _stream_of(self, point):
        """The state bytes of ``point``, pulled into the driver (a sharded one consolidated into whole tensors)."""
        if isinstance(point, ShardedPoint):
            return checkpoint.state_to_bytes(point.whole_state(self._timeout_s))
        return point.fetch(self._timeout_s)

    def models(self, to_cpu=False):
        """Rank 0's unwrapped models (CPU copies with ``to_cpu``)."""
        self.ensure_workers()
        return self.first_answer("get_models", to_cpu)

    def full_models(self):
        """Rank 0's whole models on CPU, gathered by every rank (sharded models: a collective all ranks take part in)."""
        self.ensure_workers()
        return self.group.run("full_models", deadline_s=self._timeout_s)[0]

    def local_operator(self):
        """The rank-0 operator living in this process, or None without ``use_local``."""
        self.ensure_workers()
        local = self.group.local_worker
        return local.operator if local is not None else None

    def load_stream(self, stream, weights_only=True, blocking=False):
        """Send checked state bytes to every worker (loaded there with ``weights_only``); they are the restart point."""
        self._load_point(RestartPoint.of_bytes(stream), weights_only, blocking)

    def _load_point(self, point, weights_only, blocking):
        """Load ``point`` on every worker (safely with ``weights_only``); it becomes the restart point."""
        self.ensure_workers()
        if blocking:
            self.run("load_restart_point", *point.load_args(weights_only))
        else:
            self.group.submit("load_restart_point", *point.load_args(weights_only))
        self.points.current, self.points.stale = point, False

    def load_checkpoint(self, directory, marker):
        """Load a checkpoint directory of ``storage_path`` on every worker, safely: its state file is read and checked
        against ``marker`` by a task on rank 0's node (:func:`~raysgd.torch.storage.parts.read_part`), never here;
        it becomes the restart point. Raises ``DamagedCheckpoint`` when the file does not match its marker."""
        self.ensure_workers()
        storage = self.durable.storage
        point = parts.read_part(storage.root, directory, marker, self.group.placed_on().get(0), storage.local,
                                timeout_s=self._timeout_s)
        try:
            self.run("load_restart_point", *point.load_args(weights_only=True))
        except CheckpointError as err:  # a safe load refused it (or it is not a trainer state)
            raise CheckpointError(f"checkpoint {directory!r} cannot be resumed from: {err}. If your operator's "
                                  f"state_dict() holds other objects than tensors, numbers, strings and "
                                  f"containers, make it return those, start with resume=False, or, if you trust "
                                  f"the checkpoint, load it with TorchTrainer.load(path, weights_only=False)") from err
        self.points.current, self.points.stale = point, getattr(point, "from_files", False)  # (see ShardedFiles)

    def load_path(self, path, weights_only=True, blocking=False):
        """Load a file written by ``save`` or a checkpoint directory (see ``TorchTrainer.load``)."""
        found = parts.find_sharded(path)  # a sharded state's folder: each worker reads its ranges of the parts
        if found is not None:
            filesystem.check_state_bytes(found.head, name=f"checkpoint {path!r}", weights_only=weights_only)
            self._load_point(found, weights_only, blocking)
            self.points.stale = True  # (see ShardedFiles)
            return
        state = filesystem.read_path(path, weights_only=weights_only)  # checked: a dict or state bytes
        if isinstance(state, bytes):
            self.load_stream(state, weights_only, blocking=blocking)
        else:
            self.load_stream(checkpoint.state_to_bytes(state), weights_only=False, blocking=blocking)  # made here

    def save(self, path, consolidated=False):
        """Write the current state to ``path`` atomically (and to ``storage_path``); returns the path. A sharded state
        is written as a checkpoint directory of its parts (each by a task on the node holding it, then the head and
        the marker: a DCP folder), or with ``consolidated`` as one file of whole tensors, made here."""
        self.ensure_workers()
        self.points.stale = True
        point = self.take_snapshot()
        if isinstance(point, ShardedPoint) and not consolidated:
            epoch = checkpoint.state_from_bytes(point.head)["rest"]["epoch"]
            self.durable.submit(lambda: self._part_of(point), states=self.component_states, reason="save",
                                epoch=epoch)  # storage_path too
            filesystem_, directory = filesystem.resolve(path)
            part = parts.ShardedRemoteParts(point, os.fspath(path), local=not is_uri(os.fspath(path)),
                                            timeout_s=self._timeout_s)
            filesystem.write_checkpoint_dir(filesystem_, directory, part, {"reason": "save", "epoch": epoch})
            return path
        stream = self._stream_of(point)
        state = checkpoint.state_from_bytes(stream)
        return checkpoint.save_state(self.durable.on_save(state, stream, states=self.component_states), path)

    def latest_commit(self):
        """The latest complete commit of the running (or last) ``train()`` call as a state dict, or None."""
        return self.commits.latest_state()
