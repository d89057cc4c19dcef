"""A run's folder ``storage_path/name/``: reported checkpoint directories, each complete once its marker is written.

Part of :mod:`raysgd.train`. Rank 0 copies the directory it reported to ``checkpoint_NNNNNN/`` and then writes the
marker ``.raysgd_report.json`` (the reported metrics, the data cursors of the prepared loaders, the world size):
a directory without its marker (a crash mid-copy) is skipped, the previous complete one is used. Works on a local
folder (files and marker ``fsync``ed) and on any ``pyarrow.fs`` URI (each file one PUT, the marker last), through
:func:`raysgd.torch.storage.filesystem.resolve`.

Example:
    >>> import os, tempfile
    >>> run = RunFolder(tempfile.mkdtemp(), "exp")
    >>> source = tempfile.mkdtemp()
    >>> _ = open(os.path.join(source, "model.pt"), "w").write("w")
    >>> first = run.write(source, {"metrics": {"loss": 1.0}})
    >>> run.latest()[1]["metrics"], os.path.basename(run.latest()[0])
    ({'loss': 1.0}, 'checkpoint_000001')
"""
import json
import logging
import os
import time

from raysgd.torch.state import checkpoint as _state_files
from raysgd.torch.storage import filesystem as _fs
from raysgd.train.checkpoint import copy_tree

logger = logging.getLogger(__name__)

MARKER = ".raysgd_report.json"
PREFIX = "checkpoint_"


def _join(*parts):
    return "/".join(part.rstrip("/") for part in parts)


class RunFolder:
    """``storage_path/name``: its checkpoint directories (see the module docstring)."""

    def __init__(self, storage_path, name):
        self.storage_path, self.name = os.fspath(storage_path), name
        self.filesystem, root = _fs.resolve(storage_path)
        self.fs_path = _join(root, name)  # the path inside the filesystem
        remote = "://" in self.storage_path
        self.path = _join(self.storage_path.split("?")[0], name) if remote else self.fs_path
        self._query = "?" + self.storage_path.split("?", 1)[1] if remote and "?" in self.storage_path else ""
        self._local = isinstance(self.filesystem, _fs.pafs.LocalFileSystem)

    def uri(self, directory_name):
        """The path or URI of ``directory_name`` inside the run (URI query options kept)."""
        return _join(self.path, directory_name) + self._query

    def check_writable(self):
        """Create the run folder; a clear error when it cannot be created."""
        try:
            self.filesystem.create_dir(self.fs_path, recursive=True)
        except (OSError, _fs.pyarrow.ArrowException) as err:
            raise ValueError(f"RunConfig(storage_path=...) expects a folder or URI this process can write; got "
                             f"{self.storage_path!r}: creating {self.fs_path!r} failed: {err}") from err

    def _entries(self):
        """``[(index, directory name)]`` of every checkpoint directory, complete or not, oldest first."""
        try:
            infos = self.filesystem.get_file_info(_fs.pafs.FileSelector(self.fs_path, allow_not_found=True))
        except OSError as err:
            logger.warning("Cannot list %s: %s", self.fs_path, err)
            return []
        found = [(int(info.base_name[len(PREFIX):]), info.base_name) for info in infos
                 if info.type == _fs.pafs.FileType.Directory and info.base_name.startswith(PREFIX)
                 and info.base_name[len(PREFIX):].isdigit()]
        return sorted(found)

    def _marker(self, name):
        try:
            with self.filesystem.open_input_file(_join(self.fs_path, name, MARKER)) as handle:
                return json.loads(handle.read().decode())
        except (FileNotFoundError, OSError, ValueError):
            return None

    def complete(self):
        """``[(uri, marker)]`` of the complete checkpoints, oldest first."""
        found = []
        for _, name in self._entries():
            marker = self._marker(name)
            if marker is not None:
                found.append((self.uri(name), marker))
        return found

    def latest(self):
        """``(uri, marker)`` of the newest complete checkpoint, or None."""
        for _, name in reversed(self._entries()):
            marker = self._marker(name)
            if marker is not None:
                return self.uri(name), marker
            logger.warning("Skipping the incomplete checkpoint %s (no marker: the copy did not finish)", name)
        return None

    def write(self, source, meta, num_to_keep=None):
        """Copy the local directory ``source`` to the next ``checkpoint_NNNNNN`` and write its marker last; prunes
        to ``num_to_keep`` complete checkpoints; returns the new checkpoint's path or URI."""
        entries = self._entries()
        index = entries[-1][0] + 1 if entries else 1
        name = f"{PREFIX}{index:06d}"
        directory = _join(self.fs_path, name)
        started = time.monotonic()
        if self._local:
            copy_tree(source, directory)
            for folder, _, files in os.walk(directory):
                for file in files:
                    _fs.fsync_file(os.path.join(folder, file))
        else:
            self.filesystem.create_dir(directory, recursive=True)
            _fs.pafs.copy_files(source, directory, source_filesystem=_fs.pafs.LocalFileSystem(),
                                destination_filesystem=self.filesystem)
        marker = {**meta, "index": index, "time": time.time()}
        with self.filesystem.open_output_stream(_join(directory, MARKER)) as handle:
            handle.write(json.dumps(marker, sort_keys=True, default=repr).encode())
        if self._local:
            _fs.fsync_file(_join(directory, MARKER))
            _state_files.fsync_directory(directory)
        logger.debug("Checkpoint %s written in %.2f s", directory, time.monotonic() - started)
        if num_to_keep is not None:
            self.prune(num_to_keep)
        return self.uri(name)

    def prune(self, num_to_keep):
        """Delete complete checkpoints beyond the newest ``num_to_keep`` (the marker first)."""
        complete = [name for _, name in self._entries() if self._marker(name) is not None]
        for name in complete[:-num_to_keep]:
            try:
                self.filesystem.delete_file(_join(self.fs_path, name, MARKER))
                self.filesystem.delete_dir(_join(self.fs_path, name))
            except OSError as err:
                logger.warning("Could not delete the old checkpoint %s: %s", name, err)
