"""``raysgd checkpoints PATH``: a run folder's checkpoints, each with its epoch, step, workers, strategy and size, and a
CRC-32 check of every file its marker lists, naming the damaged ones.

Part of :mod:`raysgd.cli`. Built on :mod:`raysgd.torch.storage.filesystem`'s format (a checkpoint folder counts
once its ``checkpoint.json`` marker is written, and the marker records each file's size and CRC-32): each file is
read once, in chunks (constant memory), and compared with its marker. The step and the number of workers come from
the state file itself (``global_step``; one random-stream record per rank, or one part per rank for a sharded
state), read with ``torch.load(weights_only=True)`` (memory-mapped for a local file, so the weights stay on disk).
The strategy is ``fsdp`` for a sharded state and ``ddp`` for a whole one (also what ``save(consolidated=True)``
writes). A folder without a marker is incomplete (a write that did not finish: a resume skips it), not damaged.

Exit status: 0 when every complete checkpoint passed its check, 1 when one is damaged, 2 for a path that is not a
raysgd checkpoint. ``--json`` prints one JSON object per checkpoint instead of the table.

Example:
    $ raysgd checkpoints /data/runs/mnist
    checkpoint           epoch    step  workers  strategy  size     written              reason  check
    checkpoint_000002        2      40        2  ddp       30.2 kB  2026-11-27 21:14:34  train   ok
"""
import io
import json
import os
import sys
import time
import zlib

import tabulate
import torch

from raysgd.cli import paths, train_folders
from raysgd.torch.state import checkpoint as state_files
from raysgd.torch.storage import filesystem

CHUNK = 8 << 20  # bytes read at a time while checking a file's CRC-32
#: How :func:`raysgd.torch.state.checkpoint.read_state` says a file is another kind of file, not a damaged checkpoint.
NOT_A_CHECKPOINT = "is not a raysgd checkpoint"
COLUMNS = ("checkpoint", "epoch", "step", "workers", "strategy", "size", "written", "reason")


def add_parser(commands, name):
    parser = commands.add_parser(
        name, help="list a run's checkpoints and check them (CRC-32)",
        description="List the checkpoints of a run folder (TorchTrainer(storage_path=...), or raysgd.train's "
                    "storage_path/name), one checkpoint folder, or a file TorchTrainer.save() wrote: epoch, step, "
                    "workers, strategy, size, when written, and a CRC-32 check of each file against its marker. "
                    "Exit status 1 when a checkpoint is damaged, 2 when PATH is not a raysgd checkpoint.")
    parser.add_argument("path", metavar="PATH", help="a run folder, a checkpoint folder or file (local or a URI "
                                                     "such as s3://bucket/run)")
    parser.add_argument("--json", action="store_true", help="one JSON object per checkpoint instead of the table")


def crc_of(fs, path):
    """``(size, crc32)`` of the file ``path``, read in chunks."""
    size, crc = 0, 0
    with fs.open_input_stream(path) as handle:
        while True:
            chunk = handle.read(CHUNK)
            if not chunk:
                return size, crc
            size, crc = size + len(chunk), zlib.crc32(chunk, crc)


def check_files(fs, directory, marker):
    """``(total bytes, problem or None)``: every file the marker lists (the state file, a sharded state's parts)
    checked against its size and CRC-32."""
    listed = [(filesystem.state_file_of(marker), marker.get("size"), marker.get("crc32"))]
    listed += [(name, *entry) for name, entry in sorted((marker.get("parts") or {}).items())]
    total = 0
    for name, size, crc in listed:
        try:
            found_size, found_crc = crc_of(fs, f"{directory}/{name}")
        except FileNotFoundError:
            return total, f"its file {name} is missing"
        total += found_size
        if (found_size, found_crc) != (size, crc):
            return total, (f"its file {name} has {found_size} bytes (CRC-32 {found_crc}); the marker says {size} "
                           f"(CRC-32 {crc})")
    return total, None


def load_head(fs, path, weights_only=True):
    """The state in the file ``path`` (``fs``: its filesystem, None for a local path; safely unless ``weights_only`` is
    False), memory-mapped when local, so its tensors are read from disk only where used: the whole state, or a sharded
    state's head."""
    if fs is None or isinstance(fs, filesystem.pafs.LocalFileSystem):
        return torch.load(path, map_location="cpu", weights_only=weights_only, mmap=True)
    with fs.open_input_file(path) as handle:
        return torch.load(io.BytesIO(handle.read()), map_location="cpu", weights_only=weights_only)


def describe_state(state, parts=None):
    """``{epoch, step, workers, strategy}`` of a loaded state (``parts``: a sharded state's part names)."""
    rest = state.get("rest", state) if isinstance(state, dict) else {}
    sharded = bool(parts) or bool(rest.get("sharded"))
    streams = rest.get("rng") or []
    return {"epoch": rest.get("epoch"), "step": rest.get("global_step"),
            "workers": len(parts) if parts else (len(streams) or None), "strategy": "fsdp" if sharded else "ddp"}


def inspect_folder(fs, directory, name):
    """The row of the checkpoint folder ``directory`` (see the module docstring)."""
    try:
        marker = filesystem.checked_marker(fs, directory)
    except filesystem.DamagedCheckpoint as err:
        complete = fs.get_file_info(f"{directory}/{filesystem.MARKER_FILE}").type == filesystem.pafs.FileType.File
        return {"checkpoint": name, "status": "damaged" if complete else "incomplete",
                "detail": str(err) if complete else f"no {filesystem.MARKER_FILE}: the write did not finish (a "
                                                    f"resume skips it)"}
    found = {"checkpoint": name, "epoch": marker.get("epoch"), "written": marker.get("time"),
             "reason": marker.get("reason"), "workers": len(marker["parts"]) if marker.get("parts") else None,
             "strategy": "fsdp" if marker.get("parts") else None}
    found["size"], problem = check_files(fs, directory, marker)
    if problem is not None:
        return {**found, "status": "damaged", "detail": f"{problem}: it cannot be resumed from or exported"}
    try:
        head = load_head(fs, f"{directory}/{filesystem.state_file_of(marker)}")
        state = describe_state(head, marker.get("parts"))
    except Exception as err:  # noqa: BLE001 (its bytes are as written: a state a safe load refuses still counts)
        return {**found, "status": "ok", "detail": f"the state does not load safely ({type(err).__name__}: "
                                                   f"{str(err).splitlines()[0][:200]}): step and workers unknown"}
    return {**found, **{k: v for k, v in state.items() if v is not None}, "epoch": marker.get("epoch", state["epoch"]),
            "status": "ok", "detail": None}


def inspect_file(found):
    """The row of a file ``save()`` wrote: no marker, so no CRC; checked by loading it (safely)."""
    name = os.path.basename(found.path.rstrip("/"))
    size: int | None
    try:
        if found.fs is None:
            state, size = state_files.load_state(found.path), os.path.getsize(found.path)
        else:
            with found.fs.open_input_file(found.fs_path) as handle:
                stream = handle.read()
            state, size = filesystem.check_state_bytes(stream, name=f"checkpoint {found.path!r}"), len(stream)
    except Exception as err:  # noqa: BLE001 (a file that does not load is what this check reports)
        if NOT_A_CHECKPOINT in str(err):  # another kind of file (text, a plain pickle, a tensor...): not damaged
            raise paths.NotACheckpoint(f"{str(err).splitlines()[0]}; {paths.EXPECTED}") from err
        size = os.path.getsize(found.path) if found.fs is None else None
        return {"checkpoint": name, "size": size, "status": "damaged", "detail": str(err).splitlines()[0]}
    if state_files.is_sharded_head(state):  # save() writes a sharded state as a folder with its marker, always
        return {"checkpoint": name, **describe_state(state), "size": size, "status": "incomplete",
                "detail": f"the head of a sharded (FSDP) state without the {filesystem.MARKER_FILE} of its folder "
                          f"(which lists its parts): a save that did not finish, or the file alone"}
    return {"checkpoint": name, **describe_state(state), "size": size, "reason": "save", "status": "ok",
            "detail": "no marker, so no CRC: checked by loading it"}


def rows(found):
    """The rows of a located path (:func:`raysgd.cli.paths.locate`), oldest first."""
    if found.kind == "file":
        return [inspect_file(found)]
    if found.kind == "checkpoint":
        return [inspect_folder(found.fs, found.fs_path, os.path.basename(found.fs_path))]
    if found.kind == "train-checkpoint":
        parent, name = found.fs_path.rsplit("/", 1)
        return train_folders.rows(found.fs, parent, [name])
    if found.kind == "train-run":
        return train_folders.rows(found.fs, found.fs_path, train_folders.checkpoint_names(found.path))
    names = paths.checkpoint_folders(found.fs, found.fs_path)
    return [inspect_folder(found.fs, found.join(name), name) for name in names]


def human_size(size):
    """``size`` bytes for people (``30.2 kB``)."""
    if size is None:
        return "-"
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return None


def table(found_rows):
    """The listing as text: the table, then a line per checkpoint that is not ok (why), then the count."""
    shown = []
    for row in found_rows:
        written = row.get("written")
        cells = [row.get(column) for column in COLUMNS]
        cells[COLUMNS.index("size")] = human_size(row.get("size"))
        cells[COLUMNS.index("written")] = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(written)) \
            if written else None
        shown.append(["-" if cell is None else cell for cell in cells] + [row["status"]])
    lines = [tabulate.tabulate(shown, headers=[*COLUMNS, "check"])]
    lines += [f"{row['checkpoint']}: {row['status']}: {row['detail']}" for row in found_rows
              if row.get("detail") and row["status"] != "ok"]
    statuses = [row["status"] for row in found_rows]
    counts = ", ".join(f"{statuses.count(s)} {s}" for s in ("ok", "complete", "damaged", "incomplete") if s in statuses)
    lines.append(f"{len(found_rows)} checkpoint(s): {counts}" if found_rows else "no checkpoint folders yet")
    return "\n".join(lines)


def main(options, out=None):
    """List ``options.path``'s checkpoints on ``out`` (stdout); returns 1 when one is damaged, else 0."""
    out = sys.stdout if out is None else out
    found_rows = rows(paths.locate(options.path))
    if options.json:
        out.write("".join(json.dumps(row, sort_keys=True, default=str) + "\n" for row in found_rows))
    else:
        out.write(table(found_rows) + "\n")
    return 1 if any(row["status"] == "damaged" for row in found_rows) else 0
