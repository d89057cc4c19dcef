"""Bad input a newcomer will try, on a real cluster: refused clearly, before any actor starts where it can be."""
import contextlib
import os
import pickle
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist

from conftest import TESTS_DIR, assert_released
from helpers import FaultyOperator, LinearOperator
from raysgd import TorchTrainer, TrainingOperator
from raysgd.torch.state import checkpoint
from raysgd.torch.errors import CheckpointError
from raysgd.utils import BATCH_SIZE
from s3_server import moto_s3

pytestmark = pytest.mark.usefixtures("ray_2cpus")


# ----------------------------------------------------------------- an operator that registers no model
@pytest.mark.parametrize("num_workers, use_local", [(1, False), (1, True), (2, False)])
def test_an_operator_registering_no_model_is_refused_at_construction(num_workers, use_local):
    """It was accepted, and the first train() failed inside a RayTaskError."""
    class DataOnly(TrainingOperator):
        def setup(self, config):
            self.register_data(train_loader=[(torch.ones(1), torch.ones(1))])

    with pytest.raises(ValueError, match=r"DataOnly.setup\(\) registered no model.*"
                                         r"self\.register\(models=\.\.\., optimizers=\.\.\.\)"):
        TorchTrainer(training_operator_cls=DataOnly, num_workers=num_workers, use_local=use_local,
                     timeout_s=30).shutdown()  # (shut down should it start after all)
    assert_released()


# ----------------------------------------------------------------- BATCH_SIZE that does not divide among the workers
def _batch_warnings(record):
    return [str(w.message) for w in record if issubclass(w.category, UserWarning) and "BATCH_SIZE" in str(w.message)]


def test_an_uneven_batch_size_warns_visibly_naming_the_split():
    """5 on 2 workers gives 4: the library's warning went to its NullHandler, so nobody saw it."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer = TorchTrainer(training_operator_cls=LinearOperator, num_workers=2, timeout_s=30,
                               config={BATCH_SIZE: 5, "data_size": 32})
    try:
        found = _batch_warnings(record)
        assert len(found) == 1, found  # at construction, not again when the workers start at that size
        assert all(word in found[0] for word in ("BATCH_SIZE 5", "2 workers", "a batch of 2", "global batch of 4"))
        assert trainer.config[BATCH_SIZE] == 4
        assert trainer.apply_all_operators(lambda op: op.config[BATCH_SIZE]) == [2, 2]
    finally:
        trainer.shutdown()


@pytest.mark.parametrize("num_workers", [2, (1, 2)])
def test_a_batch_size_smaller_than_the_workers_is_refused_before_any_actor_starts(num_workers):
    """Each worker silently got a batch of 1 (a global batch larger than asked); the range is checked at its largest
    size, so no resize can give a worker 0 later."""
    with pytest.raises(ValueError, match=r"config\[BATCH_SIZE\] expects an int >= the number of workers \(2\).*got 1"):
        TorchTrainer(training_operator_cls=LinearOperator, num_workers=num_workers, timeout_s=30,
                     config={BATCH_SIZE: 1}).shutdown()
    assert_released()


@pytest.mark.slow
def test_a_resize_to_an_uneven_size_warns_once_per_size(tmp_path):
    """num_workers=(2, 3) on 2 CPUs starts 2 workers: 9 divides among 3 but not among 2. A worker lost mid-call
    restarts the group, which splits BATCH_SIZE again: the size already reported is not reported again."""
    config = {BATCH_SIZE: 9, "data_size": 72, "batch_sleep": 0.01,
              "fault": {"rank": 1, "batch": 2, "kind": "exit", "marker": str(tmp_path / "fault")}}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer = TorchTrainer(training_operator_cls=FaultyOperator, num_workers=(2, 3), timeout_s=30, config=config)
        try:
            assert trainer.worker_group.num_workers == 2  # 3 do not fit
            at_start = _batch_warnings(record)
            trainer.train()  # rank 1 exits mid-call; the call goes on after a restart
            assert trainer.num_failures == 1 and os.path.exists(tmp_path / "fault")
        finally:
            trainer.shutdown()
    assert len(at_start) == 1 and "BATCH_SIZE 9 does not divide among 2 workers" in at_start[0], at_start
    assert "a batch of 4" in at_start[0]
    assert _batch_warnings(record) == at_start  # once per size


def test_fixed_worker_batch_reports_a_changed_global_batch_as_a_warning():
    from raysgd.torch.sharding import batch_split

    with pytest.warns(UserWarning, match=r"3 workers of at most 4 accumulate 1 .* global batch 3/4"):
        worker_config, effective = batch_split.split_fixed({BATCH_SIZE: 8}, 3, 4)
    assert worker_config[BATCH_SIZE] == 2 and effective == 6
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert batch_split.split_fixed({BATCH_SIZE: 8}, 2, 4)[1] == 8  # an exact split says nothing


# ----------------------------------------------------------------- load() of what is not a checkpoint
@pytest.fixture
def trainer():
    made = TorchTrainer(training_operator_cls=LinearOperator, num_workers=1, timeout_s=60, use_local=True,
                        config={"lr": 0.05, "data_size": 32})  # rank 0 in this process: no actor to start
    made.train()
    yield made
    made.shutdown()


def _weights(trainer):
    return [p.detach().clone() for p in trainer.get_model().parameters()]


def test_load_of_a_file_that_is_not_a_checkpoint_names_it(trainer, tmp_path):
    """A text file gave a raw ``KeyError: 101``, a pickle of ``{}`` advice to trust it with weights_only=False."""
    before = _weights(trainer)
    (tmp_path / "notes.txt").write_text("epoch 3: loss 0.1\n")
    (tmp_path / "empty.pkl").write_bytes(pickle.dumps({}))
    (tmp_path / "empty").write_bytes(b"")
    torch.save({"weight": torch.ones(1)}, tmp_path / "weights.pt")
    for name in ("notes.txt", "empty.pkl", "empty", "weights.pt"):
        with pytest.raises(CheckpointError) as info:
            trainer.load(str(tmp_path / name))
        assert name in str(info.value) and "not a raysgd checkpoint" in str(info.value), str(info.value)
        assert "weights_only=False" not in str(info.value)
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "trainer.checkpoint").write_text("not a state")  # a 1.x-style checkpoint directory
    with pytest.raises(CheckpointError, match="trainer.checkpoint.*not a raysgd checkpoint"):
        trainer.load(str(tmp_path / "dir"))
    assert all(torch.equal(a, b) for a, b in zip(_weights(trainer), before))  # nothing reached the workers


def test_load_state_dict_checks_what_it_is_given(trainer):
    good = trainer.state_dict()
    for bad in ({}, {"epoch": 1}, [good], {"weight": torch.ones(1)}, b"", b"garbage", pickle.dumps({}),
                checkpoint.state_to_bytes([1, 2])):
        with pytest.raises(CheckpointError, match="not a raysgd checkpoint"):
            trainer.load_state_dict(bad, blocking=True)
    trainer.train()  # the workers never saw any of it



@pytest.mark.parametrize("max_retries", [-1, 1.5, "3"])
def test_a_bad_max_retries_is_refused_before_the_dataset_is_read_or_the_logdir_made(trainer, tmp_path, max_retries):
    """``train(max_retries=...)`` was checked after ``dataset`` had been asked for its input (a 1.x Dataset splits
    its shards there) and the progress bar started; ``profile`` made its ``logdir`` first."""
    asked = []

    class Shards:  # what ``train(dataset=...)`` asks of a 1.x ``raysgd.data.Dataset``
        def as_dataset_input(self, repeat):
            asked.append(repeat)
            raise AssertionError("the dataset was read before max_retries was checked")

    for call in (lambda: trainer.train(max_retries=max_retries, dataset=Shards()),
                 lambda: trainer.validate(max_retries=max_retries),
                 lambda: trainer.profile(num_steps=1, logdir=tmp_path / "traces", max_retries=max_retries)):
        with pytest.raises(ValueError, match="max_retries expects an int >= 0"):
            call()
    assert asked == [] and not (tmp_path / "traces").exists()


def test_the_calls_on_every_worker_check_their_function_and_stack_traces_its_timeout(trainer):
    """A non-callable ``fn`` was sent to every worker (each raised ``'int' object is not callable``), and
    ``stack_traces(timeout_s="5")`` failed inside Ray's wait, on the run it was meant to diagnose."""
    for call, name in ((trainer.apply_all_workers, "apply_all_workers"),
                       (trainer.apply_all_operators, "apply_all_operators")):
        with pytest.raises(TypeError, match=rf"{name}: fn expects a function .*; got int"):
            call(3)
    for timeout_s in ("5", -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="stack_traces: timeout_s expects a number of seconds >= 0"):
            trainer.stack_traces(timeout_s)
    assert trainer.apply_all_operators(lambda operator: operator.world_rank) == [0]
    assert list(trainer.stack_traces(np.float32(0.5))) == list(trainer.stack_traces(None)) == [0]

class _Opaque:
    """Operator state a safe load refuses (a class of this module)."""

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, _Opaque) and other.value == self.value


def test_load_state_dict_bytes_are_loaded_safely_unless_trusted(trainer):
    """Bytes were unpickled with weights_only=False on every worker."""
    state = trainer.state_dict()
    stream = checkpoint.state_to_bytes({**state, "operator": {"kept": _Opaque(7)}})
    with pytest.raises(CheckpointError, match=r"safe load \(weights_only=True\).*weights_only=False"):
        trainer.load_state_dict(stream, blocking=True)
    trainer.load_state_dict(stream, blocking=True, weights_only=False)  # trusted input that needs more
    trainer.load_state_dict(checkpoint.state_to_bytes(state), blocking=True)  # plain bytes load safely
    assert trainer.state_dict()["epoch"] == state["epoch"]


def test_worker_loads_user_bytes_safely(tmp_path):
    """The worker's own safety, whatever the driver checked: ``load_state_stream(..., weights_only=True)``."""
    from raysgd.torch.execution.worker import TorchWorker

    worker = TorchWorker(LinearOperator, {"data_size": 8}, is_local=True)
    worker.setup_operator()
    state = worker.state_dict()
    unsafe = checkpoint.state_to_bytes({**state, "operator": _Opaque(1)})
    with pytest.raises(CheckpointError, match="weights_only"):
        worker.load_state_stream(unsafe, weights_only=True)
    worker.load_state_stream(unsafe)  # this job's own snapshots stay trusted
    with pytest.raises(CheckpointError, match="not a raysgd checkpoint"):
        worker.load_state_stream(pickle.dumps({}), weights_only=True)


def test_tune_load_checkpoint_of_what_is_not_a_checkpoint(trainer, tmp_path):
    pytest.importorskip("ray.tune")
    from raysgd.torch.integrations import tune as raysgd_tune

    trainable = object.__new__(raysgd_tune.BaseTorchTrainable)  # no Tune run needed for load_checkpoint
    trainable._trainer = trainer
    (tmp_path / raysgd_tune.CHECKPOINT_FILE).write_bytes(pickle.dumps({}))
    for path in (tmp_path, tmp_path / raysgd_tune.CHECKPOINT_FILE):
        with pytest.raises(CheckpointError, match="not a raysgd checkpoint"):
            trainable.load_checkpoint(str(path))
    saved = trainer.save(str(tmp_path / raysgd_tune.CHECKPOINT_FILE))  # a 1.x trial checkpoint: the file alone
    expected = _weights(trainer)
    trainer.train()
    trainable.load_checkpoint(str(tmp_path))
    assert all(torch.equal(a, b) for a, b in zip(_weights(trainer), expected))
    trainer.train()
    trainable.load_checkpoint(saved)
    assert all(torch.equal(a, b) for a, b in zip(_weights(trainer), expected))


# ----------------------------------------------------------------- a storage_path that cannot be written
@contextlib.contextmanager
def read_only_folder(path):
    """A real read-only file system (a tmpfs mounted ``ro``): root writes into a chmod'ed folder all the same."""
    path.mkdir()
    try:
        made = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        pytest.skip(f"cannot mount a read-only tmpfs here: {err}")
    if made.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here (needs root and CAP_SYS_ADMIN): {made.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], capture_output=True, timeout=30)


def _refused(storage_path):
    with pytest.raises(ValueError, match="storage_path expects a folder or URI this process can write") as info:
        TorchTrainer(training_operator_cls=LinearOperator, storage_path=storage_path, timeout_s=30).shutdown()
    assert repr(storage_path) in str(info.value) and info.value.__cause__ is not None  # the storage's own error
    assert_released()  # refused before any actor started
    return info.value


def test_a_storage_path_under_a_regular_file_is_refused_at_construction(tmp_path):
    """It was accepted: the second train() failed, and one train() without shutdown() exited 0 having written
    nothing."""
    (tmp_path / "notes.txt").write_text("a file, not a folder")
    assert isinstance(_refused(str(tmp_path / "notes.txt" / "run")).__cause__, OSError)


def test_a_read_only_storage_path_is_refused_at_construction(tmp_path):
    with read_only_folder(tmp_path / "ro") as folder:
        _refused(str(folder / "run"))


def test_a_storage_path_in_a_missing_bucket_is_refused_and_a_good_one_keeps_no_test_file(tmp_path):
    import pyarrow.fs as pafs

    with moto_s3() as (bucket, query):
        _refused(f"s3://no-such-bucket/run{query}")
        trainer = TorchTrainer(training_operator_cls=LinearOperator, storage_path=f"{bucket}/run{query}",
                               timeout_s=30)
        trainer.shutdown()
        filesystem, path = pafs.FileSystem.from_uri(f"{bucket}/run{query}")
        assert filesystem.get_file_info(pafs.FileSelector(path, allow_not_found=True)) == []  # written, deleted
    local = tmp_path / "local-run"
    TorchTrainer(training_operator_cls=LinearOperator, storage_path=str(local), timeout_s=30).shutdown()
    assert os.listdir(local) == []


UNFLUSHED_SCRIPT = """
import atexit, shutil, sys, threading
atexit.register(lambda: open(sys.argv[1] + ".early", "a").write("ran"))  # registered before raysgd's hook
sys.path.insert(0, {tests!r})
import ray
from helpers import FaultyOperator, LinearOperator
from raysgd import TorchTrainer
from raysgd.torch.storage.filesystem import CheckpointStorage

run, script_ended = sys.argv[1], threading.Event()
real_write = CheckpointStorage.write
# the upload starts once the script has ended (else it may fail before train() returns, which then raises it)
CheckpointStorage.write = lambda self, *args: script_ended.wait(60) and real_write(self, *args)
ray.init(address="local", num_cpus=1, include_dashboard=False)  # its processes inherit the tests' PYTHONPATH
trainer = TorchTrainer(training_operator_cls=LinearOperator, num_workers=1, use_local=True, storage_path=run,
                       timeout_s=60, config={{"data_size": 16}})
shutil.rmtree(run, ignore_errors=True)  # (the folder exists once the check made it)
open(run, "w").write("the storage went away after the construction check")
trainer.train()  # returns; its checkpoint upload fails on the writer thread
atexit.register(lambda: open(sys.argv[1] + ".late", "a").write("ran"))  # registered after it
sys.stdout.write("TRAINED\\n")
script_ended.set()
# the script ends without trainer.shutdown(), and configures no logging
"""


def test_an_upload_that_failed_is_never_silent_when_the_script_ends_without_shutdown(tmp_path):
    """A real driver whose storage breaks after the construction check: its exit status is 1 and stderr names
    the failed upload (it exited 0, silently, having written nothing)."""
    script = tmp_path / "driver.py"
    script.write_text(UNFLUSHED_SCRIPT.format(tests=TESTS_DIR))
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "RAY_DEDUP_LOGS": "0"})
    output = f"exit status {done.returncode}\nstdout:\n{done.stdout[-2000:]}\nstderr:\n{done.stderr[-6000:]}"
    assert "TRAINED" in done.stdout and done.returncode == 1, output
    assert "A checkpoint was not written" in done.stderr and "Not a directory" in done.stderr, output
    for handler in ("early", "late"):  # the program's other exit handlers ran, once each
        assert (tmp_path / f"run.{handler}").read_text() == "ran", handler


# ----------------------------------------------------------------- operators of the user's own script or test file
def test_an_operator_reading_self_config_and_using_dist_ships_from_a_test_module():
    """``TypeError: cannot pickle 'ConfigModuleInstance'``: a class defined here is sent by value, and with ``dist``
    (this module's ``torch.distributed``) and the name ``config`` cloudpickle took ``torch.distributed.config``."""
    class ConfigReader(LinearOperator):
        def train_batch(self, batch, batch_info):
            metrics = super().train_batch(batch, batch_info)
            metrics["world"] = dist.get_world_size() if dist.is_initialized() else 1
            metrics["lr_seen"] = self.config["lr"]
            return metrics

    trainer = TorchTrainer(training_operator_cls=ConfigReader, num_workers=2, timeout_s=60,
                           config={"lr": 0.05, "data_size": 32})
    try:
        stats = trainer.train()
        assert stats["world"] == 2 and stats["lr_seen"] == 0.05
        assert trainer.apply_all_operators(lambda op: dist.get_rank() + op.config["lr"]) == [0.05, 1.05]
    finally:
        trainer.shutdown()
    pytest.importorskip("ray.tune")
    from ray import cloudpickle

    trainable = TorchTrainer.as_trainable(training_operator_cls=ConfigReader, config={"lr": 0.05})
    assert cloudpickle.loads(cloudpickle.dumps(trainable))._trainer_kwargs["config"] == {"lr": 0.05}  # Tune's way


SCRIPT_OPERATOR = """
import os, sys

import ray
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from raysgd import TorchTrainer, TrainingOperator


class ScriptOperator(TrainingOperator):  # RaySGD 1.x operators were written like this, in the user's script
    def setup(self, config):
        torch.manual_seed(0)
        model = nn.Linear(1, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=self.config["lr"])
        self.model, self.optimizer, self.criterion = self.register(models=model, optimizers=optimizer,
                                                                   criterion=nn.MSELoss())
        x = torch.randn(32, 1)
        loader = DataLoader(TensorDataset(x, 2 * x), batch_size=8)
        self.register_data(train_loader=loader, validation_loader=loader)

    def train_batch(self, batch, batch_info):  # dist and self.config in one method: what broke
        metrics = super().train_batch(batch, batch_info)
        metrics["world"] = dist.get_world_size() if dist.is_initialized() else 1
        metrics["lr_seen"] = self.config["lr"]
        return metrics


if __name__ == "__main__":
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    trainer = TorchTrainer(training_operator_cls=ScriptOperator, num_workers=2, config={{"lr": 0.01}}, timeout_s=60)
    print("TRAINED world", trainer.train()["world"], flush=True)
    trainer.shutdown()
    from ray import tune

    tuner = tune.Tuner(TorchTrainer.as_trainable(training_operator_cls=ScriptOperator, num_workers=1,
                                                 config={{"lr": 0.01}}),
                       run_config=tune.RunConfig(stop={{"training_iteration": 1}}, storage_path={storage!r},
                                                 verbose=0))
    results = tuner.fit()
    assert not results.errors, results.errors
    print("TUNED world", results[0].metrics["world"], flush=True)
"""


@pytest.mark.slow
def test_an_operator_defined_in_the_users_script_starts_on_workers_and_in_tune(tmp_path):
    """The same from a plain driver script (a ``__main__`` operator), with 2 workers and as a Tune trial."""
    pytest.importorskip("ray.tune")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT_OPERATOR.format(storage=str(tmp_path / "tune")))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          cwd=str(tmp_path))
    output = f"exit status {done.returncode}\nstdout:\n{done.stdout[-2000:]}\nstderr:\n{done.stderr[-6000:]}"
    assert done.returncode == 0, output
    assert "TRAINED world 2" in done.stdout and "TUNED world 1" in done.stdout, output
