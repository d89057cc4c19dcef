"""A reported checkpoint: a directory on a local disk or in a ``pyarrow.fs`` filesystem, with its metadata.

Part of :mod:`raysgd.train`. :class:`Checkpoint` names a directory as Ray Train's does: ``path`` is the path inside
``filesystem`` (a ``pyarrow.fs`` filesystem: ``Checkpoint("s3://bucket/run/checkpoint_000002")`` has the path
``bucket/run/checkpoint_000002`` in an S3 filesystem, URI query options such as ``endpoint_override`` kept in the
filesystem). :meth:`Checkpoint.as_directory` gives a local path to read it (the directory itself when it is local,
a temporary download otherwise), :meth:`Checkpoint.to_directory` copies it, and ``set_metadata``,
``update_metadata`` and ``get_metadata`` keep a JSON dict in its ``.metadata.json`` (which travels with the
directory when it is reported). :class:`ReportedCheckpoint` pairs a checkpoint with the metrics reported with it.

Example:
    >>> import os, tempfile
    >>> folder = tempfile.mkdtemp()
    >>> _ = open(os.path.join(folder, "model.pt"), "w").write("weights")
    >>> checkpoint = Checkpoint.from_directory(folder)
    >>> checkpoint.set_metadata({"epoch": 3})
    >>> with checkpoint.as_directory() as local:
    ...     sorted(os.listdir(local))
    ['.metadata.json', 'model.pt']
    >>> checkpoint.get_metadata()
    {'epoch': 3}
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile

from raysgd import optional
from raysgd.base.checks import argument_error, expect, is_path
from raysgd.base.paths import is_uri, local_path
from raysgd.torch.storage import filesystem as _fs
from typing import Any, Iterator

#: How ``Checkpoint(...)``'s errors name an argument and its value: ``Checkpoint(path=...) expects ...; got int 3``.
_CHECKPOINT = {"caller": "Checkpoint", "call": True, "typed": True}


def copy_tree(source: str, destination: str) -> None:
    """Copy the directory ``source`` to ``destination`` (each a local path or a pyarrow.fs URI)."""
    local_source, local_destination = local_path(source), local_path(destination)
    if local_source is not None and local_destination is not None:
        shutil.copytree(local_source, local_destination, dirs_exist_ok=True)
        return
    source_fs, source_path = _fs.resolve(source)
    destination_fs, destination_path = _fs.resolve(destination)
    destination_fs.create_dir(destination_path, recursive=True)
    _fs.pafs.copy_files(source_path, destination_path, source_filesystem=source_fs,
                        destination_filesystem=destination_fs)


class Checkpoint:
    """A directory of checkpoint files, local or in a ``pyarrow.fs`` filesystem.

    Args:
        path: a local directory, or a URI (``s3://bucket/run/checkpoint_000002?endpoint_override=...``,
            ``gs://``, ``hdfs://``, ``file://``); with ``filesystem``, the path inside it (no scheme).
        filesystem: a ``pyarrow.fs.FileSystem`` (default: the one the URI names, or the local one).

    Attributes:
        path: the path inside :attr:`filesystem` (Ray Train's meaning: ``bucket/run/checkpoint_000002`` for S3).
        filesystem: the ``pyarrow.fs`` filesystem holding it.

    Example:
        >>> Checkpoint("/tmp/ckpt")
        Checkpoint(filesystem=local, path=/tmp/ckpt)
        >>> Checkpoint("s3://bucket/run/checkpoint_000001?region=us-east-1").path
        'bucket/run/checkpoint_000001'
    """

    def __init__(self, path: str | os.PathLike, filesystem: object = None) -> None:
        expect(is_path(path), "path", "a directory path or URI (str)", path, TypeError, **_CHECKPOINT)
        text = os.fspath(path)
        self._filesystem, self._uri = None, None
        if filesystem is not None:
            optional.require("pyarrow.fs", _fs.FEATURE)
            expect(isinstance(filesystem, _fs.pafs.FileSystem), "filesystem", "a pyarrow.fs.FileSystem", filesystem,
                   TypeError, **_CHECKPOINT)
            if is_uri(text):
                raise ValueError(f"Checkpoint(path=..., filesystem=...): with a filesystem the path is a path inside "
                                 f"it, without a scheme; got {text!r} (pass the URI alone instead)")
            self._filesystem, self.path = filesystem, text.rstrip("/") or "/"
            self._local = isinstance(filesystem, _fs.pafs.LocalFileSystem)
            self._uri = self.path if self._local else None
            return
        local = local_path(text)
        if local is not None:  # the local filesystem is made on first use: no pyarrow needed before
            self.path = self._uri = local
            self._local = True
            return
        try:
            self._filesystem, self.path = _fs.resolve(text)
        except ValueError as err:
            raise argument_error("path", "a local directory or a URI that pyarrow.fs understands (s3://, gs://, "
                                 "hdfs://, file://)", text, caller="Checkpoint", call=True,
                                 got=f"{text!r}: {err}") from err
        self._uri, self._local = text, isinstance(self._filesystem, _fs.pafs.LocalFileSystem)

    @classmethod
    def from_directory(cls, path: str | os.PathLike) -> Checkpoint:
        """A checkpoint of the existing local directory ``path`` (its files are copied when it is reported).

        Example:
            >>> Checkpoint.from_directory("/no/such/folder")
            Traceback (most recent call last):
            ...
            FileNotFoundError: Checkpoint.from_directory(path=...) expects an existing local directory; got '/no/such/folder', which does not exist
        """
        how = {"caller": "Checkpoint.from_directory", "call": True}
        expect(is_path(path), "path", "a local directory (str)", path, TypeError, typed=True, **how)
        text = os.fspath(path)
        local = local_path(text)
        if local is None:
            raise argument_error("path", "a local directory", text, ValueError, **how,
                                 got=f"the URI {text!r}: use Checkpoint({text!r}) for a directory in remote storage")
        expect(os.path.exists(local), "path", "an existing local directory", local, FileNotFoundError,
               got=f"{local!r}, which does not exist", **how)
        expect(os.path.isdir(local), "path", "a directory", local, NotADirectoryError, got=f"{local!r}, a file", **how)
        return cls(local)

    @property
    def filesystem(self) -> Any:
        """The ``pyarrow.fs`` filesystem holding the directory."""
        if self._filesystem is None:
            self._filesystem = _fs.resolve(self.path)[0]
        return self._filesystem

    @property
    def is_local(self) -> bool:
        """Whether the directory is on this machine's filesystem (raysgd's addition)."""
        return self._local

    @property
    def uri(self) -> str | None:
        """What ``Checkpoint(uri)`` resolves back to this directory: the local path, or the URI it was made from
        (query options kept); None when it was made from a path inside a remote ``filesystem`` (raysgd's addition).

        Example:
            >>> Checkpoint("s3://b/run/checkpoint_000001?region=us-east-1").uri
            's3://b/run/checkpoint_000001?region=us-east-1'
        """
        return self._uri

    def _file(self, name):
        return f"{self.path.rstrip('/')}/{name}"

    def _download(self, destination):
        os.makedirs(destination, exist_ok=True)
        _fs.pafs.copy_files(self.path, destination, source_filesystem=self.filesystem,
                            destination_filesystem=_fs.pafs.LocalFileSystem())

    @contextlib.contextmanager
    def as_directory(self) -> Iterator[str]:
        """A local directory holding the checkpoint's files: itself when local, else a temporary download (removed
        when the block ends); treat it as read-only."""
        if self.is_local:
            yield self.path
            return
        with tempfile.TemporaryDirectory(prefix="raysgd-checkpoint-") as folder:
            self._download(folder)
            yield folder

    def to_directory(self, path: str | os.PathLike | None = None) -> str:
        """Copy the checkpoint's files to the local directory ``path`` (default: a new temporary one); returns it.
        raysgd's own files of a reported checkpoint (its marker, the callbacks' state) are not copied. The
        checkpoint's own directory is returned as it is (its files are there).

        Example:
            >>> Checkpoint.from_directory(tempfile.mkdtemp()).to_directory("s3://bucket/copy")
            Traceback (most recent call last):
            ...
            ValueError: Checkpoint.to_directory(path=...) expects None or a local directory; got 's3://bucket/copy'
        """
        how = {"caller": "Checkpoint.to_directory", "call": True}
        expect(path is None or is_path(path) or path == "", "path", "None or a local directory", path, TypeError,
               typed=True, **how)  # "": the working directory, as in Ray Train
        local = local_path(path) if path is not None else tempfile.mkdtemp(prefix="raysgd-checkpoint-")
        expect(local is not None, "path", "None or a local directory", path, **how)
        path = str(local)
        if self.is_local:
            top = os.path.abspath(self.path)
            if os.path.isdir(top) and os.path.isdir(path) and os.path.samefile(top, path):
                return path  # copying it onto itself: shutil failed with an unreadable error
            shutil.copytree(self.path, path, dirs_exist_ok=True,
                            ignore=lambda folder, names: [name for name in names if name in _fs.REPORT_FILES
                                                          and os.path.abspath(folder) == top])
        else:
            self._download(path)
            for name in _fs.REPORT_FILES:
                if os.path.isfile(os.path.join(path, name)):
                    os.remove(os.path.join(path, name))
        return path

    def get_metadata(self) -> dict[str, Any]:
        """The metadata dict kept with the checkpoint (``.metadata.json``), or ``{}`` when none was set."""
        if self.is_local:
            try:
                with open(self._file(_fs.CHECKPOINT_METADATA), "rb") as handle:
                    return json.loads(handle.read().decode())
            except FileNotFoundError:
                return {}
        if self.filesystem.get_file_info(self._file(_fs.CHECKPOINT_METADATA)).type == _fs.pafs.FileType.NotFound:
            return {}
        with self.filesystem.open_input_stream(self._file(_fs.CHECKPOINT_METADATA)) as handle:
            return json.loads(handle.readall().decode())

    def set_metadata(self, metadata: dict[str, Any]) -> None:
        """Keep ``metadata`` (a dict JSON can write) with the checkpoint, replacing what was there.

        Example:
            >>> Checkpoint.from_directory(tempfile.mkdtemp()).set_metadata({"model": object()})
            Traceback (most recent call last):
            ...
            TypeError: Checkpoint.set_metadata(metadata=...) expects a dict that JSON can write (str keys; numbers, strings, bools, None, lists and dicts as values); got one it cannot write: Object of type object is not JSON serializable
        """
        how = {"error": TypeError, "caller": "Checkpoint.set_metadata", "call": True}
        expect(isinstance(metadata, dict), "metadata", "a dict", metadata, typed=True, **how)
        try:
            data = json.dumps(metadata).encode()
        except (TypeError, ValueError) as err:
            raise argument_error("metadata", "a dict that JSON can write (str keys; numbers, strings, bools, None, "
                                 "lists and dicts as values)", metadata, got=f"one it cannot write: {err}",
                                 **how) from err
        if self.is_local:
            if not os.path.isdir(self.path):
                raise FileNotFoundError(f"Checkpoint.set_metadata: the checkpoint's directory {self.path!r} does not "
                                        f"exist")
            temporary = self._file(f"{_fs.CHECKPOINT_METADATA}.{os.getpid()}.tmp")
            with open(temporary, "wb") as handle:
                handle.write(data)
            os.replace(temporary, self._file(_fs.CHECKPOINT_METADATA))  # readers see the old or the new, never half
            return
        with self.filesystem.open_output_stream(self._file(_fs.CHECKPOINT_METADATA)) as handle:
            handle.write(data)

    def update_metadata(self, metadata: dict[str, Any]) -> None:
        """Add ``metadata``'s keys to the checkpoint's metadata (replacing those it had)."""
        expect(isinstance(metadata, dict), "metadata", "a dict", metadata, TypeError, "Checkpoint.update_metadata",
               call=True, typed=True)
        self.set_metadata({**self.get_metadata(), **metadata})

    def _identity(self):
        return ("local" if self.is_local else self.filesystem.type_name), self.path

    def __eq__(self, other):
        return isinstance(other, Checkpoint) and other._identity() == self._identity()

    def __hash__(self):
        return hash(self._identity())

    def __fspath__(self):
        raise TypeError("A Checkpoint is not a path: use checkpoint.as_directory() or checkpoint.to_directory() "
                        "(or checkpoint.path, the path inside checkpoint.filesystem)")

    def __repr__(self):
        return f"Checkpoint(filesystem={self._identity()[0]}, path={self.path})"


@dataclasses.dataclass
class ReportedCheckpoint:
    """A reported checkpoint and the metrics reported with it (``get_all_reported_checkpoints()``'s items).

    Example:
        >>> ReportedCheckpoint(Checkpoint("/tmp/run/checkpoint_000001"), {"loss": 0.5}).metrics
        {'loss': 0.5}
    """

    checkpoint: Checkpoint
    metrics: dict
