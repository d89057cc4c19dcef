"""Checkpoint files: atomic writes (temporary file and rename) and safe, clear loads.

Layer 1 helper (torch and the standard library). A checkpoint is the trainer state dict
``{epoch, global_step, operator, models, optimizers[, schedulers][, amp_*]}``. A file gets the
permissions the umask allows (``0666 & ~umask``, like ``open(path, "wb")``), and the folder is
fsynced after the rename, so the new name survives a power loss.

Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> save_state({"epoch": 1, "models": [], "optimizers": [], "operator": None}, path) == path
    True
    >>> load_state(path)["epoch"]
    1
"""
import io
import os
import pickle
import uuid

import torch

from raysgd.torch.errors import CheckpointError

_REQUIRED = ("epoch", "models", "optimizers")


def state_to_bytes(state):
    """``torch.save`` bytes of ``state``."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def state_from_bytes(stream, map_location="cpu"):
    """The state dict in :func:`state_to_bytes` bytes (trusted: they come from this job's own workers)."""
    return torch.load(io.BytesIO(stream), map_location=map_location, weights_only=False)


def save_state(state, path):
    """Write ``state`` to ``path`` atomically: a crash mid-write leaves any older file at ``path`` intact."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f"{os.path.basename(path)}.{uuid.uuid4().hex[:12]}.tmp")
    # os.open with 0o666 lets the umask decide (tempfile.mkstemp would force 0600, unreadable to the group).
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_directory(directory)
    return path


def fsync_directory(directory):
    """Flush ``directory``'s entries (a rename into it) to disk; a no-op where folders cannot be opened.

    Example:
        >>> import tempfile
        >>> fsync_directory(tempfile.gettempdir())
    """
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
    try:
        fd = os.open(directory, flags)
    except OSError:  # Windows cannot open a folder: its renames are durable without this
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems (e.g. certain network mounts) refuse fsync on a folder
        pass
    finally:
        os.close(fd)


def load_state(path, weights_only=True):
    """Read a checkpoint written by :func:`save_state`.

    With ``weights_only=True`` (the default) the file can hold only tensors, numbers, strings and
    containers, so loading it cannot run code. Pass ``weights_only=False`` only for files you trust
    whose operator state needs arbitrary pickled objects.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise CheckpointError(f"checkpoint file {path!r} is a directory: pass the file save() wrote (a checkpoint "
                              f"directory of storage_path or Tune loads with TorchTrainer.load)")
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path!r} does not exist")
    return read_state(path, f"checkpoint {path!r}", weights_only=weights_only,
                      trust_hint="if you trust the file, load it with weights_only=False")


def read_state(source, name, *, weights_only=True, trust_hint, damaged=CheckpointError):
    """``torch.load`` of a trainer state (a path or a binary file object) onto the CPU, with clear errors.

    A safe load (``weights_only=True``) that meets other objects raises :class:`CheckpointError` naming
    ``name`` and ending with ``trust_hint``; a damaged or foreign file raises ``damaged`` (a
    :class:`CheckpointError` class).

    Example:
        >>> import io
        >>> buffer = io.BytesIO(state_to_bytes({"epoch": 1, "models": [], "optimizers": []}))
        >>> read_state(buffer, "my state", trust_hint="")["epoch"]
        1
    """
    try:
        state = torch.load(source, map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError as err:
        if weights_only and "weights_only" in str(err):
            raise CheckpointError(f"{name} holds objects that a safe load (weights_only=True) refuses; {trust_hint}. "
                                  f"Detail: {str(err).splitlines()[0]}") from err
        raise damaged(f"{name} is corrupted or truncated: {err}") from err
    except (RuntimeError, EOFError, OSError, ValueError, AttributeError, ImportError) as err:
        raise damaged(f"{name} is corrupted or truncated: {type(err).__name__}: {err}") from err
    if not isinstance(state, dict) or any(key not in state for key in _REQUIRED):
        raise damaged(f"{name} is not a raysgd checkpoint: expected a dict with keys {_REQUIRED}")
    return state
