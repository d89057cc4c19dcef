"""Checkpoint parts written where the state is: a 0-CPU Ray task on the node holding a restart point writes the
state file to ``storage_path``, so a durable checkpoint's bytes never pass through the driver.

Layer 3 (ray, and :mod:`~raysgd.torch.storage.filesystem`). The driver's checkpoint writer
(:class:`~raysgd.torch.storage.durable.DurableRun`, on its background thread) hands a :class:`RemotePart` to
:func:`~raysgd.torch.storage.filesystem.write_checkpoint_dir`, which calls :meth:`RemotePart.write_to`: the task
fetches the first available copy of the state (:func:`raysgd.torch.state.restart_point.first_available`: on the
node holding it this is a read of the local object store), writes it, ``fsync``s a local file and answers
``(size, crc32)``; the driver then writes the small marker, last, as before. The task runs on the node of the
state's first copy for an object store or other URI (``s3://``), and on the driver's node for a local path (a
folder that may exist on the driver's disk only; NFS works either way). A resume reads the other way:
:func:`read_part` checks a checkpoint's state file against its marker in a task on rank 0's node and leaves the
bytes in that node's object store, where every worker loads them from.

Example:
    >>> # part = RemotePart(point.refs, point.nodes[0], storage.root, storage.local, timeout_s=600)
    >>> # write_checkpoint_dir(fs, directory, part, meta) -> the marker, with the size and CRC the task measured
"""
import logging
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raysgd.torch.state import checkpoint, restart_point
from raysgd.torch.storage import filesystem

logger = logging.getLogger(__name__)

#: DCP's metadata file of a sharded checkpoint (the folder then loads with DCP's own ``FileSystemReader`` too).
DCP_METADATA = ".metadata"


def _write(refs, root, path, timeout_s, overlay=None):
    """On the holder's node: write the first available copy of ``refs`` (updated with ``overlay``, a commit's
    per-rank records) to ``path`` under ``root``."""
    fs, _ = filesystem.resolve(root)
    stream = restart_point.first_available(refs, timeout_s)
    if overlay:
        stream = checkpoint.state_to_bytes({**checkpoint.state_from_bytes(stream), **overlay})
    return filesystem.write_state_file(fs, path, stream)


_write_task = None


class RemotePart:
    """The state file of a checkpoint, written by a task on the node holding the state (see the module docstring).

    Args:
        refs: the restart point's refs (the same bytes on different nodes, the preferred first).
        node: the node of the first copy (None: anywhere).
        root: ``storage_path`` as :func:`~raysgd.torch.storage.filesystem.resolve` takes it on any node.
        local: whether ``root`` is a local folder (then the task runs on this process's node).
        timeout_s: the deadline of the whole write.
        overlay: what the state is updated with before it is written (a commit's per-rank records), or None.

    Example:
        >>> RemotePart([], None, "/tmp/run", local=True, timeout_s=5).timeout_s
        5
    """

    def __init__(self, refs, node, root, local, timeout_s=600, overlay=None):
        self.refs, self.root, self.timeout_s, self.overlay = list(refs), root, timeout_s, overlay
        self.node = restart_point.this_node() if local else node

    def start(self, directory, name):
        """Start the task writing ``directory/name``; returns its ref (answering ``(size, crc32)``)."""
        global _write_task
        if _write_task is None:
            _write_task = ray.remote(num_cpus=0, max_retries=0)(_write)
        options = {} if self.node is None else {
            "scheduling_strategy": NodeAffinitySchedulingStrategy(self.node, soft=True)}  # elsewhere if it is gone
        return _write_task.options(**options).remote(self.refs, self.root, f"{directory}/{name}", self.timeout_s,
                                                     self.overlay)

    def write_to(self, directory, name):
        """Write the state as ``directory/name`` (a task on :attr:`node`); returns ``(size, crc32)``. A failed or
        overdue write raises (the checkpoint then has no marker and does not count)."""
        started = time.monotonic()
        size, crc32 = ray.get(self.start(directory, name), timeout=self.timeout_s)
        logger.debug("state part %s/%s written on node %s (%.1f MB, %.2f s)", directory, name,
                     (self.node or "?")[:12], size / 1e6, time.monotonic() - started)
        return size, crc32


class ShardedRemoteParts:
    """The files of a sharded state's checkpoint (a :class:`~raysgd.torch.state.restart_point.ShardedPoint`): each
    rank's part written by a task on the node holding it (in parallel), then, from this process, the small head
    (the rest of the state, updated with the overlay, and the DCP metadata) as the state file and the DCP
    ``.metadata``: the folder is a DCP checkpoint of the models and optimizers too. The marker lists every part's
    size and CRC-32.

    Example:
        >>> ShardedRemoteParts(None, "/tmp/run", local=True, timeout_s=5).timeout_s
        5
    """

    def __init__(self, point, root, local, timeout_s=600):
        self.point, self.root, self.local, self.timeout_s = point, root, local, timeout_s

    def write_to(self, directory, name):
        """Write every file into ``directory`` (the head as ``name``); returns ``(size, crc32, {"parts": {file:
        [size, crc32]}})`` for the marker. A failed or overdue write raises (no marker: the checkpoint does not
        count)."""
        names = [restart_point.part_file_name(rank) for rank in range(len(self.point.parts))]
        writers = [RemotePart(part.refs, part.nodes[0], self.root, self.local, timeout_s=self.timeout_s)
                   for part in self.point.parts]
        calls = [writer.start(directory, file) for writer, file in zip(writers, names)]
        fs, _ = filesystem.resolve(self.root)
        head = checkpoint.state_from_bytes(self.point.head)
        head["rest"].update(self.point.overlay or {})
        filesystem.write_state_file(fs, f"{directory}/{DCP_METADATA}", head["metadata"])
        size, crc32 = filesystem.write_state_file(fs, f"{directory}/{name}", checkpoint.state_to_bytes(head))
        deadline = time.monotonic() + self.timeout_s
        written = {file: list(ray.get(call, timeout=max(1.0, deadline - time.monotonic())))
                   for file, call in zip(names, calls)}
        return size, crc32, {"parts": written}


def _read(root, directory, marker, name=filesystem.STATE_FILE):
    """On a worker's node: ``(info, state bytes)`` of ``directory``'s state file checked against ``marker``;
    ``({"damaged": why}, None)`` when it does not match."""
    fs, _ = filesystem.resolve(root)
    try:
        stream = filesystem.read_state_file(fs, directory, marker, name)
    except filesystem.DamagedCheckpoint as err:
        return {"damaged": str(err)}, None
    return {"bytes": len(stream), "node": restart_point.this_node()}, stream


_read_task = None


def read_part(root, directory, marker, node, local, timeout_s=600):
    """A :class:`~raysgd.torch.state.restart_point.RestartPoint` of a checkpoint's state file, read by a task on
    ``node`` (the driver's for a ``local`` root) into that node's object store, checked against ``marker`` (size,
    CRC-32), never through this process; :class:`~raysgd.torch.storage.filesystem.DamagedCheckpoint` when it does
    not match. The workers then load it safely (``weights_only=True``)."""
    global _read_task
    if _read_task is None:
        _read_task = ray.remote(num_cpus=0, max_retries=0, num_returns=2)(_read)
    node = restart_point.this_node() if local else node
    options = {} if node is None else {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=True)}
    names = [filesystem.STATE_FILE] + sorted(marker.get("parts") or {}, key=_part_rank)
    started = [_read_task.options(**options).remote(root, directory, marker, name) for name in names]
    deadline = time.monotonic() + timeout_s
    points = []
    for info_ref, data_ref in started:
        info = ray.get(info_ref, timeout=max(1.0, deadline - time.monotonic()))
        if "damaged" in info:
            raise filesystem.DamagedCheckpoint(info["damaged"])
        points.append(restart_point.RestartPoint([data_ref], nbytes=info["bytes"], nodes=[info["node"]]))
    if len(points) == 1:
        return points[0]
    head = restart_point.first_available(points[0].refs, timeout_s)  # small: the rest of the state and metadata
    if [restart_point.part_file_name(rank) for rank in range(len(points) - 1)] != names[1:]:
        raise filesystem.DamagedCheckpoint(f"checkpoint {directory!r}: its parts {names[1:]} are not one per rank")
    return restart_point.ShardedPoint(points[1:], head=bytes(head))


def _part_rank(name):
    """The saving rank of a part's file name (``__3_0.distcp`` -> 3); -1 for a name of another form."""
    try:
        return int(name.split("_")[2])
    except (IndexError, ValueError):
        return -1
