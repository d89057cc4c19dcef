"""The checkpoints of a ``raysgd.train`` run folder (``storage_path/name``), as ``raysgd checkpoints`` lists them.

Part of :mod:`raysgd.cli`, kept apart: the function API's checkpoints hold the user's own files, every rank's
merged, and their marker (:data:`raysgd.torch.storage.filesystem.REPORT_MARKER`, written last) lists each file with
its size and CRC-32, the reported metrics and the world size: a checkpoint here is complete (every file checked),
damaged (a file missing or not as listed) or incomplete (no marker).

Example:
    >>> row({"metrics": {"epoch": 2, "step": 40}, "world_size": 2, "time": 0}, "checkpoint_000003", 2048)["step"]
    40
"""
from raysgd.torch.storage import filesystem, rank_files

MARKER = filesystem.REPORT_MARKER

#: Metric names read as the epoch and the step, in order of preference.
EPOCH_KEYS = ("epoch", "training_iteration")
STEP_KEYS = ("step", "global_step", "steps")


def _first(metrics, keys):
    return next((metrics[key] for key in keys if key in metrics), None)


def row(marker, name, size):
    """The listing's row of the checkpoint ``name`` with ``marker`` (its ``.raysgd_report.json``), ``size`` bytes."""
    metrics = marker.get("metrics") or {}
    return {"checkpoint": name, "epoch": _first(metrics, EPOCH_KEYS), "step": _first(metrics, STEP_KEYS),
            "workers": marker.get("world_size"), "strategy": None, "size": size, "written": marker.get("time"),
            "reason": "report", "status": "complete", "detail": f"{len(marker.get('files') or {})} file(s) checked"}


def checkpoint_names(path):
    """The names of the checkpoint folders of the run folder ``path`` (a local path or a URI), oldest first:
    ``checkpoint_NNNNNN`` (complete or not) and those named by ``report(checkpoint_dir_name=...)`` (ordered by their
    marker's index; one without a readable marker is no checkpoint of the run).

    Example:
        >>> import tempfile
        >>> checkpoint_names(tempfile.mkdtemp())
        []
    """
    storage = filesystem.CheckpointStorage(path, None, marker=MARKER)
    return [directory.rsplit("/", 1)[-1] for _, directory in storage.list()]


def rows(fs, run_path, names):
    """The rows of the checkpoint folders ``names`` under ``run_path`` (oldest first)."""
    found = []
    for name in names:
        directory = f"{run_path}/{name}"
        files = [info for info in fs.get_file_info(filesystem.pafs.FileSelector(directory, recursive=True)) if info.is_file]
        size = sum(info.size or 0 for info in files)
        if fs.get_file_info(f"{directory}/{MARKER}").type != filesystem.pafs.FileType.File:
            found.append({"checkpoint": name, "size": size, "status": "incomplete",
                          "detail": f"no {MARKER}: the copy did not finish (a resume skips it)"})
            continue
        try:
            marker = filesystem.read_marker(fs, directory, MARKER)
            rank_files.verify(fs, directory, marker, crc=True)
        except (filesystem.DamagedCheckpoint, OSError) as err:
            found.append({"checkpoint": name, "size": size, "status": "damaged", "detail": str(err)})
            continue
        found.append(row(marker, name, size))
    return found
