"""The sharded state format (raysgd.torch.state.sharded, dcp_blobs) and its files (raysgd.torch.storage.dcp_files).

One spawned gloo world of 3 CPU processes (tests/dcp_ranks.py) runs the distributed part once for the module: FSDP2
models trained with Adam at 2 ranks, saved as in-memory parts, as torch's own FileSystemWriter folder and to a real
S3 server (moto); loaded at 3 ranks and at 1. The tests compare what it wrote against the full state before the save,
bit for bit. The rest runs in this process without a process group.
"""
import ctypes
import gc
import io
import json
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import re
import socket
import warnings

import pytest
import torch
import torch.multiprocessing as mp

import dcp_ranks
from helpers import join_ranks
from raysgd.torch.errors import CheckpointError
from raysgd.torch.state import sharded
from raysgd.torch.storage import dcp_files
from s3_server import CREDENTIALS, free_port, moto_s3

DEADLINE_S = 180
PRELOAD = ["torch.distributed.fsdp", "torch.distributed.checkpoint", "raysgd.torch.state.sharded",
           "raysgd.torch.storage.dcp_files"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Run tests/dcp_ranks.py's world once; returns its output folder. The ranks are forked by a fork server that
    imported what they need (torch, FSDP2, raysgd) once while the S3 server starts, instead of 3 processes importing
    it side by side (about 3x faster on 2 cores). Python 3.11's fork server does not take this process's sys.path:
    it preloads modules importable from its own path (dcp_ranks is not: each rank imports that small module). When
    an earlier test of this pytest process started the fork server (a DataLoader's workers), it is used as it is.

    A rank killed by a signal died inside native code (raysgd's code here is Python; torch's gloo and FSDP2,
    pyarrow's S3 client are not): CI saw one rank abort once, on glibc's ``malloc_consolidate(): invalid chunk
    size``, and 100+ runs here (with glibc's malloc checks, with both cores busy) never did. Such a world runs once
    more, with a warning naming the rank and the signal; its ranks print every thread's Python stack when they die
    of a signal (``faulthandler``), so the warning comes with where. A rank that raised, a second crash or a world
    past its deadline fails the tests."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    multiprocessing.forkserver.ensure_running()  # imports in the background while moto starts
    for attempt in (1, 2):
        out = str(tmp_path_factory.mktemp("dcp"))
        try:
            _run_world(out)
            return out
        except mp.ProcessExitedException as err:
            if err.signal_name is None or attempt == 2:
                raise
            warnings.warn(f"DCP rank {err.error_index} (pid {err.error_pid}) died of {err.signal_name}, a crash in "
                          f"native code (its stack is in the captured stderr); running the 3 ranks once more")


def _run_world(out):
    """The 3 ranks of tests/dcp_ranks.py against a fresh S3 server, writing into ``out``; raises what
    ``torch.multiprocessing``'s join raises for a rank that failed, or TimeoutError past :data:`DEADLINE_S`."""
    with moto_s3() as s3:
        context = mp.start_processes(dcp_ranks.main, args=(free_port(), out, s3, CREDENTIALS), nprocs=3,
                                     join=False, start_method="forkserver")
        join_ranks(context, "the 3 DCP ranks", DEADLINE_S)


def _load(out, name):
    return torch.load(os.path.join(out, f"{name}.pt"), weights_only=True)


def _differences(expected, got, path="state"):
    """Where two nested states differ (tensors bit for bit: dtype, shape and every value), as readable lines."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor) or expected.dtype != got.dtype or expected.shape != got.shape:
            return [f"{path}: expected {expected.dtype} {tuple(expected.shape)}, got {got!r:.80}"]
        return [] if torch.equal(expected, got) else [f"{path}: values differ (max {(expected - got).abs().max()})"]
    if isinstance(expected, dict):
        if not isinstance(got, dict) or set(expected) != set(got):
            return [f"{path}: keys {sorted(map(str, expected))} expected, got "
                    f"{sorted(map(str, got)) if isinstance(got, dict) else type(got).__name__}"]
        return [line for key in expected for line in _differences(expected[key], got[key], f"{path}[{key!r}]")]
    if isinstance(expected, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(expected) != len(got):
            return [f"{path}: {len(expected)} items expected, got {got!r:.80}"]
        return [line for index, pair in enumerate(zip(expected, got)) for line in _differences(*pair, f"{path}[{index}]")]
    return [] if expected == got else [f"{path}: expected {expected!r}, got {got!r}"]


def _assert_same_state(reference, loaded):
    assert set(reference["optimizers"][0]["state"]["0.weight"]) == {"step", "exp_avg", "exp_avg_sq"}
    assert reference["optimizers"][0]["state"]["0.weight"]["step"].item() == 3  # trained: not a fresh state
    assert _differences(reference, loaded) == []


@pytest.mark.parametrize("name", ["loaded_3", "loaded_1", "loaded_3_ranged"])
def test_fsdp2_state_saved_at_2_ranks_loads_bit_exact_at_3_and_at_1(ranks, name):
    _assert_same_state(_load(ranks, "reference"), _load(ranks, name))


def test_the_parts_are_a_dcp_folder_that_torchs_file_system_reader_loads(ranks):
    _assert_same_state(_load(ranks, "reference"), _load(ranks, "loaded_3_torch_reader"))


def test_a_folder_torchs_file_system_writer_wrote_loads_with_our_reader(ranks):
    _assert_same_state(_load(ranks, "reference"), _load(ranks, "loaded_3_from_torch_writer"))


def test_the_blobs_lie_out_exactly_as_torchs_file_system_writer_writes_them(ranks):
    ours, theirs = (pickle.loads(open(os.path.join(ranks, folder, ".metadata"), "rb").read()) for folder in
                    ("mem", "fsw"))
    assert ours.state_dict_metadata == theirs.state_dict_metadata and ours.planner_data == theirs.planner_data
    where = {index: (info.relative_path, info.offset, info.length) for index, info in ours.storage_data.items()}
    assert where == {index: (info.relative_path, info.offset, info.length) for index, info in
                     theirs.storage_data.items()}
    sizes = {name: os.path.getsize(os.path.join(ranks, "mem", name)) for name in ("__0_0.distcp", "__1_0.distcp")}
    assert sharded.file_sizes(open(os.path.join(ranks, "mem", ".metadata"), "rb").read()) == sizes
    assert sizes == {name: os.path.getsize(os.path.join(ranks, "fsw", name)) for name in sizes}


def test_an_s3_checkpoint_written_at_2_ranks_loads_at_3(ranks):
    _assert_same_state(_load(ranks, "reference"), _load(ranks, "loaded_3_s3"))


def test_a_rank_fetches_only_the_files_its_shard_needs_each_once(ranks):
    logs = [json.load(open(os.path.join(ranks, f"rank{rank}.json"))) for rank in range(3)]
    for log in logs:
        assert sorted(log["fetched"]) == log["needed"] and len(set(log["fetched"])) == len(log["fetched"])
        assert sorted(log["lazy_fetched"]) == log["lazy_needed"]
    # rows 0-5 were rank 0's and 6-11 rank 1's; at 3 ranks rank 0 holds 0-3, rank 1 4-7, rank 2 8-11
    assert [log["lazy_fetched"] for log in logs] == [["__0_0.distcp"], ["__0_0.distcp", "__1_0.distcp"],
                                                     ["__1_0.distcp"]]


def test_with_the_layout_a_rank_reads_only_its_rows_and_the_replicated_values(ranks):
    """The layout (where each tensor item's raw bytes start) lets a rank read the rows its new shard takes out of
    the saved shards: 12 rows saved 6/6 at 2 ranks, loaded 4/4/4 at 3 (rank 1 reads rows 4-5 of rank 0's part and
    6-7 of rank 1's), exactly the bytes it loads; without it each overlapping item is read whole."""
    logs = [json.load(open(os.path.join(ranks, f"rank{rank}.json"))) for rank in range(3)]
    for log in logs:
        assert log["lazy_same"] and log["lazy_ranged"]["read"] == log["lazy_ranged"]["needed"]
        assert log["lazy_ranged"]["needed"] == 4 * 4 * 4 + 4 * 4  # its 4 rows of the weight and of the bias
        assert log["ranged"]["read"] == log["ranged"]["needed"], log["ranged"]


def test_consolidate_gives_the_full_state_in_one_process(ranks):
    reference = _load(ranks, "reference")
    for folder in ("mem", "fsw"):
        full = dcp_files.consolidate(os.path.join(ranks, folder))
        assert _differences(reference["models"], full["models"]) == []
        assert _differences(reference["optimizers"][0]["state"], full["optimizers"][0]["state"]) == []
        assert full["optimizers"][0]["param_groups"][0]["lr"] == 0.01


def test_plain_modules_without_a_process_group_round_trip():
    model, fresh = torch.nn.Linear(7, 5), torch.nn.Linear(7, 5)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(3, 7)).sum().backward()
    optimizer.step()
    part = sharded.save_parts(sharded.models_and_optimizers_state([model], [optimizer]))
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.5)
    state = sharded.models_and_optimizers_state([fresh], [fresh_optimizer], metadata=part.metadata)
    sharded.load_parts(state, part.metadata, {part.file_name: part.blob}.__getitem__)
    sharded.load_models_and_optimizers([fresh], [fresh_optimizer], state)
    assert _differences({"m": model.state_dict(), "o": optimizer.state_dict()},
                        {"m": fresh.state_dict(), "o": fresh_optimizer.state_dict()}) == []


def test_an_optimizer_over_two_models_is_keyed_by_model_index_and_round_trips():
    models, fresh = [torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)], [torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)]
    optimizer = torch.optim.SGD([p for m in models for p in m.parameters()], lr=0.1, momentum=0.9)
    models[1](models[0](torch.randn(4, 3))).sum().backward()
    optimizer.step()
    state = sharded.models_and_optimizers_state(models, [optimizer])
    assert sorted(state["optimizers"][0]["state"]) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    part = sharded.save_parts(state)
    fresh_optimizer = torch.optim.SGD([p for m in fresh for p in m.parameters()], lr=0.5, momentum=0.9)
    target = sharded.models_and_optimizers_state(fresh, [fresh_optimizer], metadata=part.metadata)
    sharded.load_parts(target, part.metadata, {part.file_name: part.blob}.__getitem__)
    sharded.load_models_and_optimizers(fresh, [fresh_optimizer], target)
    assert _differences({"m": [m.state_dict() for m in models], "o": optimizer.state_dict()},
                        {"m": [m.state_dict() for m in fresh], "o": fresh_optimizer.state_dict()}) == []
    with pytest.raises(ValueError, match="the state holds 1 optimizers; got 0"):
        sharded.load_models_and_optimizers(fresh, [], target)
    with pytest.raises(ValueError, match="got one with 2 parameter.s. of no registered model"):
        sharded.models_and_optimizers_state(fresh[:1], [torch.optim.SGD(fresh[1].parameters(), lr=0.1)])


def test_a_truncated_blob_or_unsafe_bytes_are_refused_with_what_was_expected():
    part = sharded.save_parts({"w": torch.ones(100), "note": {"lr": 0.5}})
    with pytest.raises(CheckpointError, match=r"expected to hold item .* got a file of 10 bytes"):
        sharded.load_parts({"w": torch.zeros(100), "note": {"lr": 0.0}}, part.metadata, lambda name: part.blob[:10])
    with pytest.raises(CheckpointError, match="refers to builtins.eval"):
        sharded.load_parts({}, pickle.dumps(eval), lambda name: b"")
    unsafe = sharded.save_parts({"w": torch.ones(1), "note": {"lr": socket.AF_INET}})  # an enum: pickled by class
    target = {"w": torch.zeros(1), "note": {"lr": None}}
    with pytest.raises(CheckpointError, match="a safe load .* refuses"):
        sharded.load_parts(target, unsafe.metadata, {unsafe.file_name: unsafe.blob}.__getitem__)
    sharded.load_parts(target, unsafe.metadata, {unsafe.file_name: unsafe.blob}.__getitem__, weights_only=False)
    assert target["note"]["lr"] == socket.AF_INET


_MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc's; None elsewhere (musl, macOS)


def _peak_rss_growth(action):
    """``action()``'s peak resident memory above what this process held before it, in bytes (Linux's VmHWM, reset
    first), and its result. Memory freed earlier in this process is handed back to the system first (glibc's
    ``malloc_trim``): an allocation that reused freed heap pages still resident would not raise the peak, so a copy
    could go unseen depending on what ran before (the control below measured 1.56x instead of 2x after other tests)."""
    gc.collect()
    _MALLOC_TRIM(0)
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # the high-water mark restarts from the current resident size
    before = _status("VmRSS")
    result = action()
    return _status("VmHWM") - before, result


def _status(key):
    with open("/proc/self/status") as handle:
        return int(re.search(rf"{key}:\s+(\d+) kB", handle.read()).group(1)) * 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="measures Linux's VmHWM")
@pytest.mark.skipif(_MALLOC_TRIM is None, reason="needs glibc's malloc_trim to measure from a trimmed heap")
def test_the_writer_holds_the_blob_and_never_a_second_copy():
    state = {f"layer{i}": torch.randn(1_000_000) for i in range(16)}  # 64 MB in 16 tensors
    size = sum(t.nbytes for t in state.values())

    def items_then_joined():  # a writer that serialises each item on its own and then makes one blob of them
        buffers = []
        for tensor in state.values():
            buffers.append(io.BytesIO())
            torch.save(tensor, buffers[-1])
        return b"".join(buffer.getbuffer() for buffer in buffers)

    growth, part = _peak_rss_growth(lambda: sharded.save_parts(state))
    assert size <= part.nbytes < size * 1.01
    del part
    naive, copy = _peak_rss_growth(items_then_joined)
    del copy
    assert growth < 1.3 * size, f"peak {growth / size:.2f}x the {size / 1e6:.0f} MB state while saving"
    assert naive > 1.6 * size, f"serialising items apart, then joining them peaked at {naive / size:.2f}x (expected about 2x)"


def test_file_names_and_sizes_come_from_the_metadata():
    part = sharded.save_parts({"w": torch.ones(3)})
    assert sharded.file_names(part.metadata) == [part.file_name]
    assert sharded.file_sizes(part.metadata) == {part.file_name: part.nbytes}
    assert sharded.files_needed({"w": torch.zeros(3)}, part.metadata) == [part.file_name]
    with pytest.raises(TypeError, match="expected as a Metadata or its bytes; got str"):
        sharded.file_names("not metadata")


def test_a_fresh_optimizer_stays_fresh_through_a_save_and_a_load():
    """DCP gives a fresh optimizer state by a step with a learning rate of 0, which Adam counts as a step: a state
    saved before the first step would then resume with a different bias correction. Saved and loaded, a fresh Adam
    stays without state, and loading it into one that stepped clears that one's state."""
    torch.manual_seed(0)
    model, stepped = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    adam = torch.optim.Adam(model.parameters(), lr=0.1)
    part = sharded.save_parts(sharded.models_and_optimizers_state([model], [adam]))
    assert len(adam.state) == 0 and all(p.grad is None for p in model.parameters())
    other = torch.optim.Adam(stepped.parameters(), lr=0.5)
    stepped(torch.ones(1, 3)).sum().backward()
    other.step()
    target = sharded.models_and_optimizers_state([stepped], [other], metadata=part.metadata)
    sharded.load_parts(target, part.metadata, {part.file_name: part.blob}.__getitem__)
    sharded.load_models_and_optimizers([stepped], [other], target)
    assert len(other.state) == 0 and other.param_groups[0]["lr"] == 0.1
    assert torch.equal(stepped.weight, model.weight)
    for optimizer, module in ((adam, model), (other, stepped)):  # the same first step from here on
        module(torch.ones(1, 3)).sum().backward()
        optimizer.step()
    assert torch.equal(stepped.weight, model.weight)


def test_tensors_not_stored_row_major_load_bit_exact_with_the_layout():
    """torch.save keeps a tensor's strides: a channels_last convolution (its weight and Adam's moments) or a
    transposed buffer is stored in another byte order than its rows, so a ranged read of rows gave scrambled values
    (silently). Such an item has no layout: it is read whole."""
    torch.manual_seed(0)

    def make():
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten())
        model.register_buffer("projection", torch.randn(4, 3).t())
        return model.to(memory_format=torch.channels_last)

    model = make()
    adam = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last)).sum().backward()
    adam.step()
    assert not model[0].weight.is_contiguous() and not model.projection.is_contiguous()
    part = sharded.save_parts(sharded.models_and_optimizers_state([model], [adam]))
    fresh = make()
    fresh_adam = torch.optim.Adam(fresh.parameters())
    target = sharded.models_and_optimizers_state([fresh], [fresh_adam], metadata=part.metadata)
    sharded.load_parts(target, part.metadata, {part.file_name: part.blob}.__getitem__, layout=part.layout)
    sharded.load_models_and_optimizers([fresh], [fresh_adam], target)
    assert _differences({"m": model.state_dict(), "o": adam.state_dict()},
                        {"m": fresh.state_dict(), "o": fresh_adam.state_dict()}) == []
    full = sharded.consolidate_parts(part.metadata, {part.file_name: part.blob}.__getitem__, layout=part.layout)
    assert _differences(model.state_dict(), full["models"][0]) == []
    assert not any(key.startswith(("models.0.0.weight", "models.0.projection")) for key in part.layout)


def test_a_whole_state_with_a_group_setting_the_optimizer_lacks_loads_as_torch_loads_it():
    """A run with an LR scheduler saves its groups' ``initial_lr``; loading that whole state (a consolidated one, or
    a strategy="ddp" run's) into an optimizer without a scheduler raised KeyError 'param_groups.0.initial_lr' inside
    DCP. torch's load_state_dict adds the setting; so does this load."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(sgd, 1, 0.5)
    for _ in range(2):
        sgd.zero_grad()
        model(torch.randn(4, 3)).sum().backward()
        sgd.step()
        scheduler.step()
    part = sharded.save_parts(sharded.models_and_optimizers_state([model], [sgd]))
    whole = sharded.consolidate_parts(part.metadata, {part.file_name: part.blob}.__getitem__)
    for state in (whole, {"models": [model.state_dict()], "optimizers": [sgd.state_dict()]}):
        fresh = torch.nn.Linear(3, 2)
        fresh_sgd = torch.optim.SGD(fresh.parameters(), lr=0.7, momentum=0.9)
        sharded.load_models_and_optimizers([fresh], [fresh_sgd], pickle.loads(pickle.dumps(state)), full=True)
        assert fresh_sgd.param_groups[0]["lr"] == 0.025 and fresh_sgd.param_groups[0]["initial_lr"] == 0.1
        assert torch.equal(fresh_sgd.state[fresh.weight]["momentum_buffer"], sgd.state[model.weight]["momentum_buffer"])


def test_a_checkpoint_of_more_models_or_optimizers_than_registered_is_refused_not_loaded_in_part():
    """DCP loads the keys the target asks for: a checkpoint of 2 models and 2 optimizers loaded into an operator
    registering 1 of each loaded the first and dropped the rest, silently (a whole state is refused so)."""
    models = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)]
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1) for model in models]
    part = sharded.save_parts(sharded.models_and_optimizers_state(models, optimizers))
    fresh = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"the checkpoint holds 2 models but 1 is registered; a partial load"):
        sharded.models_and_optimizers_state([fresh], [torch.optim.SGD(fresh.parameters(), lr=0.1)],
                                            metadata=part.metadata)
    with pytest.raises(ValueError, match=r"the checkpoint holds 2 optimizers but 1 is registered"):
        sharded.models_and_optimizers_state(models, optimizers[:1], metadata=part.metadata)
    assert sharded.saved_counts(part.metadata) == {"models": 2, "optimizers": 2}


def test_a_checkpoint_lacking_a_group_setting_the_optimizer_has_loads_keeping_the_optimizers_value():
    """An older torch's optimizer saves fewer settings per group (Adam before ``decoupled_weight_decay``): DCP
    refused the load ("Missing key in checkpoint state_dict: optimizers.0.param_groups.0.decoupled_weight_decay")
    where torch's own load_state_dict keeps the optimizer's default for it."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    adam = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    adam.step()
    state = sharded.models_and_optimizers_state([model], [adam])
    for group in state["optimizers"][0]["param_groups"]:
        del group["decoupled_weight_decay"]  # as an older torch saved it
    part = sharded.save_parts(state)
    fresh = torch.nn.Linear(3, 2)
    fresh_adam = torch.optim.Adam(fresh.parameters(), lr=0.5)
    target = sharded.models_and_optimizers_state([fresh], [fresh_adam], metadata=part.metadata)
    sharded.load_parts(target, part.metadata, {part.file_name: part.blob}.__getitem__)
    sharded.load_models_and_optimizers([fresh], [fresh_adam], target)
    assert fresh_adam.param_groups[0]["lr"] == 0.1 and fresh_adam.param_groups[0]["decoupled_weight_decay"] is False
    assert torch.equal(fresh_adam.state[fresh.weight]["exp_avg"], adam.state[model.weight]["exp_avg"])
    for optimizer, module in ((adam, model), (fresh_adam, fresh)):  # the same next step
        optimizer.zero_grad()
        module(torch.ones(1, 3)).sum().backward()
        optimizer.step()
    assert torch.equal(fresh.weight, model.weight)
