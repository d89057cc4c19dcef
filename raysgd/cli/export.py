"""``raysgd export PATH OUT``: the models' weights of a checkpoint, consolidated into whole tensors, as one safetensors
file for serving (no optimizer state, no pickle).

Part of :mod:`raysgd.cli`; needs ``safetensors`` (``pip install "raysgd[export]"``). ``PATH`` is a checkpoint folder
(``storage_path``'s ``checkpoint_NNNNNN``, or what ``save()`` writes under ``strategy="fsdp"``), a run folder (its
newest checkpoint that passes the CRC-32 check; a damaged newer one is named and skipped), or a file ``save()``
wrote. A folder is checked against its marker first (:mod:`raysgd.cli.checkpoints`): a damaged checkpoint is never
exported. A sharded (FSDP) state is consolidated from its parts by the DCP metadata of the state file its marker
names (:func:`models_in`: the save the marker names, never a newer one a killed save left); a whole (DDP) state is
read as it is. Loads are safe (``weights_only=True``) unless ``--trust``.

With one model the keys are the model's own (``model.load_state_dict(safetensors.torch.load_file(OUT))``); with
several, each key starts with the model's index (``0.weight``, ``1.weight``), or ``--model I`` exports model ``I``
alone. The file's metadata records the source, its epoch and step. Tensors sharing memory (tied weights) are
written once each under every key. ``OUT`` is a local file path (not a folder, not a URI), checked before anything is
read, and written atomically (a temporary file, then a rename); an existing ``OUT`` is kept unless ``--overwrite``.

Example:
    $ raysgd export /data/runs/mnist model.safetensors
    exported checkpoint_000004 (epoch 4, step 80): 1 model, 2 tensors, 8 B -> model.safetensors
"""
import os
import pickle
import sys
import uuid

import torch

from raysgd import optional
from raysgd.base.checks import argument_error, expect
from raysgd.base.durable_files import fsync_directory
from raysgd.base.paths import expand_path, is_uri
from raysgd.cli import checkpoints, paths
from raysgd.torch.errors import CheckpointError
from raysgd.torch.state import checkpoint as state_files
from raysgd.torch.storage import filesystem

FEATURE = "raysgd export (safetensors files)"


def add_parser(commands, name):
    parser = commands.add_parser(
        name, help="write a checkpoint's model weights as safetensors",
        description="Write the model weights of a checkpoint (DDP or FSDP, consolidated into whole tensors) as one "
                    "safetensors file, for serving. PATH: a checkpoint folder, a run folder (its newest checkpoint "
                    "that passes the CRC-32 check) or a file TorchTrainer.save() wrote.")
    parser.add_argument("path", metavar="PATH", help="a checkpoint folder, a run folder, or a file save() wrote")
    parser.add_argument("out", metavar="OUT", help="the safetensors file to write (e.g. model.safetensors)")
    parser.add_argument("--model", type=int, metavar="I", help="export model I alone (with several models)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT when it exists")
    parser.add_argument("--trust", action="store_true",
                        help="load the state with weights_only=False (only for checkpoints you trust: it can run code)")


def newest_good(found):
    """``(row, directory)`` of a run folder's newest checkpoint that passes its check; the skipped newer ones are
    written to stderr. :class:`~raysgd.torch.errors.CheckpointError` when none does."""
    names = paths.checkpoint_folders(found.fs, found.fs_path)[::-1]
    for name in names:
        row = checkpoints.inspect_folder(found.fs, found.join(name), name)
        if row["status"] == "ok":
            return row, found.join(name)
        sys.stderr.write(f"raysgd export: skipping {name}: {row['status']}: {row['detail']}\n")
    raise CheckpointError(f"{found.path!r} has no complete, undamaged checkpoint to export ({len(names)} checked)")


def load_models(path, trust=False):
    """``(models, row)``: the model state dicts of the checkpoint at ``path`` (whole CPU tensors) and its listing row."""
    found = paths.locate(path)
    if found.kind in ("train-run", "train-checkpoint"):
        raise paths.NotACheckpoint(
            f"{path!r} is a raysgd.train run folder: its checkpoints hold your own files (what your training function "
            f"saved), which raysgd export cannot read; load yours with torch.load and write it with "
            f"safetensors.torch.save_file. raysgd export reads TorchTrainer checkpoints")
    if found.kind == "file":
        row = checkpoints.inspect_file(found)
        if row["status"] != "ok":
            raise CheckpointError(f"{path!r} cannot be exported: {row['detail']}")
        return models_in(found.fs, found.fs_path or found.path, trust), row
    if found.kind == "run":
        row, directory = newest_good(found)
    else:
        directory = found.fs_path
        row = checkpoints.inspect_folder(found.fs, directory, os.path.basename(directory))
        if row["status"] != "ok":
            raise CheckpointError(f"{path!r} cannot be exported: {row['status']}: {row['detail']}")
    marker = filesystem.checked_marker(found.fs, directory)
    return models_in(found.fs, f"{directory}/{filesystem.state_file_of(marker)}", trust, marker), row


def models_in(fs, path, trust, marker=None):
    """The models of the state in the file ``path`` (memory-mapped when local). A sharded state's file (the head of a
    checkpoint folder whose ``marker`` lists its parts) is consolidated into whole tensors from the parts by the DCP
    metadata it holds: the save the marker names, each part checked against the marker's size and CRC-32 (never
    DCP's ``.metadata`` file, which a save killed before its marker may have left naming newer parts). A state a safe
    load refuses is a :class:`~raysgd.torch.errors.CheckpointError` saying ``--trust`` loads it; so is a sharded
    state's head without its folder's marker (its parts unchecked).

    Example:
        >>> models_in(None, "run/checkpoint_000002/trainer.checkpoint", trust=False)[0]["weight"]  # doctest: +SKIP
        tensor([[0.5000]])
    """
    try:
        state = checkpoints.load_head(fs, path, weights_only=not trust)
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"{path!r} holds objects that a safe load (weights_only=True) refuses: if you trust the "
                              f"checkpoint, pass --trust. Detail: {str(err).splitlines()[0]}") from err
    if not state_files.is_sharded_head(state):
        return state["models"]
    if not (marker or {}).get("parts"):
        raise CheckpointError(f"{path!r} is the head of a sharded (FSDP) state, whose models are in the parts of its "
                              f"checkpoint folder: expected that folder with its {filesystem.MARKER_FILE} (which "
                              f"checks the parts); got the head without it (a save that did not finish, or the file "
                              f"alone)")
    from raysgd.torch.state import sharded  # noqa: PLC0415 (DCP's import: 1.2 s, for sharded states only)

    directory = path.rsplit("/", 1)[0]
    filesystem_ = fs if fs is not None else filesystem.resolve(directory)[0]
    return sharded.consolidate_parts(
        state["metadata"], lambda name: filesystem.read_state_file(filesystem_, directory, marker, name),
        weights_only=not trust, layout=state.get("layout"))["models"]


def flatten(models, index=None):
    """``{key: tensor}`` to write: model ``index``'s keys, the one model's, or each model's behind its index; the
    non-tensor entries (a module's extra state) are left out and named."""
    models = list(models.values()) if isinstance(models, dict) else list(models)
    if index is not None:
        expect(0 <= index < len(models), "--model", f"an index below {len(models)} (the checkpoint holds "
               f"{len(models)} model(s))", index, paths.BadArgument)
        chosen = {"": models[index]}
    else:
        chosen = {"" if len(models) == 1 else f"{i}.": state for i, state in enumerate(models)}
    tensors, skipped = {}, []
    for prefix, state in chosen.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[prefix + key] = value
            else:
                skipped.append(prefix + key)
    return tensors, skipped, len(chosen)


def writable(tensors):
    """The tensors as safetensors writes them: contiguous and on the CPU, a copy of each further key sharing memory
    with an earlier one (tied weights)."""
    storages, ready = set(), {}
    for key, tensor in tensors.items():
        tensor = tensor.detach().to("cpu").contiguous()
        storage = tensor.untyped_storage().data_ptr() if tensor.numel() else None
        if storage is not None and storage in storages:
            tensor = tensor.clone()
        storages.add(storage)
        ready[key] = tensor
    return ready


def check_out(out, overwrite=False):
    """Check the ``OUT`` argument before anything is read: a local file path (no URI, no folder), not an existing file
    unless ``overwrite``; :class:`~raysgd.cli.paths.BadArgument` or ``FileExistsError`` naming it otherwise.

    Example:
        >>> check_out("s3://bucket/model.safetensors")
        Traceback (most recent call last):
        ...
        raysgd.cli.paths.BadArgument: OUT expects the path of a local file to write ...
    """
    expected = "the path of a local file to write (such as model.safetensors)"
    if is_uri(out):
        raise argument_error("OUT", expected, out, paths.BadArgument,
                             got=f"{out!r}, a URI (export writes a local file: copy it to the object store after)")
    if out.endswith(("/", os.sep)) or os.path.isdir(out):
        raise argument_error("OUT", expected, out, paths.BadArgument, got=f"{out!r}, a folder")
    if os.path.exists(out) and not overwrite:
        raise FileExistsError(f"OUT {out!r} exists: pass --overwrite to replace it, or another path")


def write(tensors, out, metadata):
    """Write ``tensors`` to ``out`` (checked first: :func:`check_out`) atomically, a temporary file renamed;
    :class:`~raysgd.cli.paths.BadArgument` for an ``out`` that cannot be written."""
    save_file = optional.require("safetensors.torch", FEATURE, extra="export").save_file
    folder = os.path.dirname(os.path.abspath(out))
    temporary = os.path.join(folder, f".{os.path.basename(out)}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        os.makedirs(folder, exist_ok=True)
        save_file(tensors, temporary, metadata=metadata)
        os.replace(temporary, out)
    except BaseException as err:
        if os.path.exists(temporary):
            os.unlink(temporary)
        if isinstance(err, OSError):
            raise argument_error("OUT", "the path of a file this process can write", out, paths.BadArgument,
                                 got=f"{out!r}: {type(err).__name__}: {err}") from err
        raise
    fsync_directory(folder)


def main(options, out=None):
    """Export ``options.path``'s models to ``options.out``; says what it wrote on ``out`` (stdout)."""
    out = sys.stdout if out is None else out
    optional.require("safetensors.torch", FEATURE, extra="export")  # before any checkpoint is read
    target = expand_path(options.out)  # ~ is the home folder, as in PATH
    check_out(target, options.overwrite)  # so is OUT
    models, row = load_models(options.path, trust=options.trust)
    tensors, skipped, count = flatten(models, options.model)
    metadata = {"format": "pt", "raysgd.source": f"{options.path} ({row['checkpoint']})",
                "raysgd.epoch": str(row.get("epoch")), "raysgd.step": str(row.get("step")),
                "raysgd.strategy": str(row.get("strategy"))}
    write(writable(tensors), target, metadata)
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    out.write(f"exported {row['checkpoint']} (epoch {row.get('epoch')}, step {row.get('step')}): {count} model(s), "
              f"{len(tensors)} tensors, {checkpoints.human_size(size)} -> {target}\n")
    if skipped:
        out.write(f"left out (not tensors): {', '.join(skipped)}\n")
    return 0
