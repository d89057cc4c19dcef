"""What a path given to the ``raysgd`` command is: a run folder, one checkpoint, a file ``save()`` wrote, or none.

Part of :mod:`raysgd.cli`. A local path or a URI (``s3://bucket/run``; through
:func:`raysgd.torch.storage.filesystem.resolve`, so folders need pyarrow: ``raysgd[storage]``):

- ``run``: ``TorchTrainer(storage_path=...)``'s folder: ``checkpoint_NNNNNN/`` folders, each complete once its
  ``checkpoint.json`` marker is written (:mod:`raysgd.torch.storage.filesystem`);
- ``checkpoint``: one such folder (also what ``save()`` writes under ``strategy="fsdp"``), or the state file its
  marker checks (``trainer.checkpoint``: then the folder is what is listed and exported);
- ``file``: a file ``TorchTrainer.save()`` wrote (or a folder holding only its ``trainer.checkpoint``);
- ``train-run`` / ``train-checkpoint``: a ``raysgd.train`` run folder (``storage_path/name``: its checkpoints
  ``checkpoint_NNNNNN`` or named by ``report(checkpoint_dir_name=...)``) or one of its checkpoints
  (:mod:`raysgd.cli.train_folders`).

Anything else raises :class:`NotACheckpoint` saying what was expected and what was found.

Example:
    >>> locate("/no/such/run")
    Traceback (most recent call last):
    ...
    raysgd.cli.paths.NotACheckpoint: '/no/such/run' does not exist: expected a run folder ...
"""
import dataclasses
import os
from typing import cast

from raysgd.base.paths import expand_path, is_uri
from raysgd.cli import train_folders
from raysgd.torch.storage import filesystem

EXPECTED = ("expected a run folder (checkpoint_NNNNNN/ folders: TorchTrainer(storage_path=...), or raysgd.train's "
            "storage_path/name), one checkpoint folder (with checkpoint.json), or a file TorchTrainer.save() wrote")


class NotACheckpoint(ValueError):
    """A path given to the ``raysgd`` command is no raysgd run folder, checkpoint or checkpoint file."""


class BadArgument(ValueError):
    """An argument of the ``raysgd`` command is not what the command expects; the message names the argument, what
    it expects and what it was given.

    Example:
        >>> raise BadArgument("--model expects an index below 1 (the checkpoint holds 1 model(s)); got 3")
        Traceback (most recent call last):
        ...
        raysgd.cli.paths.BadArgument: --model expects an index below 1 (the checkpoint holds 1 model(s)); got 3
    """


@dataclasses.dataclass
class Found:
    """A located path: ``kind`` (see the module docstring), the path as given, and for a folder its filesystem and
    the path inside it."""

    kind: str
    path: str
    fs: object = None
    fs_path: str | None = None

    def join(self, *names):
        """The path inside the filesystem of ``names`` under this folder."""
        return "/".join([cast(str, self.fs_path).rstrip("/"), *names])  # set for a folder (the only kind joined)

    def uri(self, *names):
        """The path as given of ``names`` under this folder (a URI's query options kept at its end).

        Example:
            >>> Found("run", "s3://bucket/run?scheme=http").uri("checkpoint_000002")
            's3://bucket/run/checkpoint_000002?scheme=http'
        """
        base, mark, query = self.path.partition("?") if is_uri(self.path) else (self.path, "", "")
        return "/".join([base.rstrip("/"), *names]) + mark + query


def parent(text):
    """The folder holding the path or URI ``text`` (a URI's query options kept at its end).

    Example:
        >>> parent("s3://bucket/run/checkpoint_000002/trainer.checkpoint?scheme=http")
        's3://bucket/run/checkpoint_000002?scheme=http'
    """
    base, mark, query = text.partition("?") if is_uri(text) else (text, "", "")
    return base.rstrip("/").rsplit("/", 1)[0] + mark + query


def is_checkpoint_name(name):
    """Whether ``name`` is a checkpoint folder's name (``checkpoint_000003``)."""
    return name.startswith(filesystem.PREFIX) and name[len(filesystem.PREFIX):].isdigit()


def children(fs, path):
    """``{name: FileInfo}`` of what the folder ``path`` holds (empty when it is no folder)."""
    try:
        infos = fs.get_file_info(filesystem.pafs.FileSelector(path, allow_not_found=True))
    except OSError as err:
        raise NotACheckpoint(f"cannot list {path!r}: {err}") from err
    return {info.base_name: info for info in infos}


def checkpoint_folders(fs, path):
    """The names of the checkpoint folders (``checkpoint_NNNNNN``) in the folder ``path``, oldest first; a file of such
    a name is none.

    Example:
        >>> import tempfile
        >>> checkpoint_folders(filesystem.pafs.LocalFileSystem(), tempfile.mkdtemp())
        []
    """
    return sorted(name for name, info in children(fs, path).items()
                  if info.type == filesystem.pafs.FileType.Directory and is_checkpoint_name(name))


def locate(path):
    """The :class:`Found` that ``path`` is; :class:`NotACheckpoint` otherwise (see the module docstring)."""
    text = expand_path(path)
    if not is_uri(text):
        if os.path.isfile(text):
            folder = os.path.dirname(text) or "."
            if os.path.basename(text) in filesystem.STATE_FILES and \
                    os.path.isfile(os.path.join(folder, filesystem.MARKER_FILE)):
                return locate(folder)  # a checkpoint folder's state file: the folder, checked against its marker
            return Found("file", text)
        if not os.path.exists(text):
            raise NotACheckpoint(f"{text!r} does not exist: {EXPECTED}")
    try:
        fs, fs_path = filesystem.resolve(text, "PATH", caller=None)
    except ValueError as err:  # a URI pyarrow cannot open: a bad argument of the command, not a traceback
        raise BadArgument(str(err)) from err
    info = fs.get_file_info(fs_path)
    if info.type == filesystem.pafs.FileType.NotFound:
        raise NotACheckpoint(f"{text!r} does not exist: {EXPECTED}")
    if info.type == filesystem.pafs.FileType.File:
        folder = fs_path.rsplit("/", 1)[0]
        if info.base_name in filesystem.STATE_FILES and \
                fs.get_file_info(f"{folder}/{filesystem.MARKER_FILE}").type == filesystem.pafs.FileType.File:
            return Found("checkpoint", parent(text), fs, folder)  # a checkpoint folder's state file: the folder
        return Found("file", text, fs, fs_path)
    inside = children(fs, fs_path)
    if filesystem.MARKER_FILE in inside:
        return Found("checkpoint", text, fs, fs_path)
    if train_folders.MARKER in inside:
        return Found("train-checkpoint", text, fs, fs_path)
    if filesystem.STATE_FILE in inside:  # a folder holding the file save() wrote
        return Found("file", text.rstrip("/") + "/" + filesystem.STATE_FILE, fs, fs_path + "/" + filesystem.STATE_FILE)
    folders = sorted(name for name, entry in inside.items()
                     if entry.type == filesystem.pafs.FileType.Directory and not name.startswith("."))
    listings: dict = {}

    def inner(name):  # each subfolder listed once, when first asked
        if name not in listings:
            listings[name] = children(fs, f"{fs_path}/{name}")
        return listings[name]

    numbered = [name for name in folders if is_checkpoint_name(name)]
    # raysgd.train's checkpoints: checkpoint_NNNNNN, or the name report(checkpoint_dir_name=...) gave, with its marker
    if any(train_folders.MARKER in inner(name) for name in numbered) or \
            any(train_folders.MARKER in inner(name) for name in folders if not is_checkpoint_name(name)):
        return Found("train-run", text, fs, fs_path)
    if numbered:
        return Found("run", text, fs, fs_path)
    runs = [name for name in folders if any(is_checkpoint_name(child) for child in inner(name))]
    if runs:
        raise NotACheckpoint(f"{text!r} holds run folders ({', '.join(runs[:5])}{', ...' if len(runs) > 5 else ''}): "
                             f"pass one of them, e.g. {text.rstrip('/')}/{runs[0]}")
    shown = sorted(inside)[:5]
    holding = f"a folder holding {', '.join(shown)}{', ...' if len(inside) > 5 else ''}" if inside else "an empty folder"
    raise NotACheckpoint(f"{text!r} is not a raysgd checkpoint: {EXPECTED}; found {holding}")
