"""raysgd.train's Ray Train 2.x surface: configs, errors, callbacks, the retention policy, collectives, Lightning FSDP
(Checkpoint and Result: test_train_checkpoints.py).

The configs, the retention policy, errors and callbacks are tested without Ray; the collectives,
``get_all_reported_checkpoints`` and Lightning's FSDP strategy run in real training functions on one shared 2-CPU
cluster. ``docs/coming-from-ray-train.md`` is checked against the installed Ray's public names both ways (every name
listed; what it says works is there, what it says is missing is not).
"""
import importlib
import json
import logging
import os
import pickle
import re
import tempfile

import numpy as np
import pytest
import torch

import raysgd.train
from conftest import REPO_DIR
from raysgd.callbacks import Callback
from raysgd.train import (Checkpoint, CheckpointConfig, FailureConfig, LoggingConfig, ReportedCheckpoint,
                          RunConfig, ScalingConfig, TrainingFailedError, UserCallback, WorkerGroupError)
from raysgd.train.callback import TrainRunContext, UserCallbacks, split_callbacks
from raysgd.train.retention import best, check_score, checkpoints_to_delete

REPO = REPO_DIR
TABLE = os.path.join(REPO, "docs", "coming-from-ray-train.md")
# ----------------------------------------------------------------------------------------------- errors, callbacks
def test_worker_group_error_has_ray_trains_shape_and_pickles_with_what_it_carries():
    cause = ValueError("bad batch")
    error = WorkerGroupError("rank 1 raised ValueError: bad batch", {1: cause}, result="the result so far")
    assert isinstance(error, TrainingFailedError) and isinstance(error, RuntimeError)
    assert str(error) == "Training failed due to worker errors:\nrank 1 raised ValueError: bad batch"
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is WorkerGroupError and str(copy) == str(error) and copy.result == "the result so far"
    assert list(copy.worker_failures) == [1] and repr(copy.worker_failures[1]) == repr(cause)
    failed = pickle.loads(pickle.dumps(TrainingFailedError("Training failed: ...", result={"loss": 1})))
    assert str(failed) == "Training failed: ..." and failed.result == {"loss": 1}
    with pytest.raises(TypeError, match=r"worker_failures=...\) expects a dict \{world rank: exception\}"):
        WorkerGroupError("x", [ValueError()])


def test_user_callbacks_are_called_in_order_and_a_raising_one_is_logged_and_skipped(caplog):
    calls = []

    class Recorder(UserCallback):
        def after_report(self, run_context, metrics, checkpoint):
            calls.append(("report", run_context.get_run_config().name, metrics, checkpoint))

        def after_exception(self, run_context, worker_exceptions):
            calls.append(("exception", sorted(worker_exceptions)))

    class Broken(UserCallback):
        def after_report(self, run_context, metrics, checkpoint):
            raise RuntimeError("boom")

    context = TrainRunContext(run_config=RunConfig(name="exp", storage_path="/tmp/r"), train_loop_config={})
    callbacks = UserCallbacks([Broken(), Recorder(), UserCallback()])
    with caplog.at_level(logging.WARNING):
        callbacks.after_report(context, [{"loss": 1.0}, {"loss": 2.0}], None)
    callbacks.after_exception(context, {1: ValueError("x"), 0: KeyError("y")})
    assert calls == [("report", "exp", [{"loss": 1.0}, {"loss": 2.0}], None), ("exception", [0, 1])]
    assert "Callback Broken.after_report raised" in caplog.text and "boom" in caplog.text
    assert len(context.run_id) == 32 and TrainRunContext().run_id != context.run_id


def test_run_config_takes_user_callbacks_and_raysgds_loggers_and_refuses_anything_else():
    from raysgd.loggers import MLflowLogger, WandbLogger

    mlflow, wandb = MLflowLogger(tracking_uri="file:///tmp/mlruns"), WandbLogger(project="p", mode="offline")
    user, operator_style = UserCallback(), Callback()
    config = RunConfig(callbacks=[user, mlflow, operator_style, wandb])
    assert config.callbacks == [user, mlflow, operator_style, wandb]
    assert split_callbacks(config.callbacks) == ([user], [mlflow, operator_style, wandb])
    assert RunConfig().callbacks == []
    with pytest.raises(TypeError, match=r"RunConfig\(callbacks=...\) expects a list of raysgd.train.UserCallback or "
                                        r"raysgd.Callback instances .*item 1 is a class, not an instance: UserCallback"):
        RunConfig(callbacks=[user, UserCallback])
    with pytest.raises(TypeError, match=r"item 0 is str 'print'"):
        RunConfig(callbacks=["print"])
    with pytest.raises(TypeError, match=r"expects a list of .*; got UserCallback"):
        RunConfig(callbacks=user)
    from ray.tune.callback import Callback as TuneCallback

    with pytest.raises(TypeError, match=r"item 0 is a Ray Tune callback \(TuneCallback\), which Ray Train 2.x no "
                                        r"longer takes either"):
        RunConfig(callbacks=[type("TuneCallback", (TuneCallback,), {})()])


# ------------------------------------------------------------------------------------------------------- configs
def test_scaling_config_resources_as_ray_train_checks_them():
    assert ScalingConfig(num_workers=3).total_resources == {"CPU": 3}
    assert ScalingConfig(num_workers=(1, 4), resources_per_worker={"CPU": 2}).total_resources == {"CPU": 8}
    assert ScalingConfig(num_workers=2, use_gpu=True).total_resources == {"CPU": 2, "GPU": 2}
    assert ScalingConfig(num_workers=2, use_gpu=True, resources_per_worker={"CPU": 0, "GPU": 0.5}).total_resources \
        == {"GPU": 1.0}
    elastic = ScalingConfig(num_workers=(2, 6), elastic_resize_monitor_interval_s=5)
    assert (elastic.min_workers, elastic.max_workers, elastic.elasticity_enabled) == (2, 6, True)
    assert not ScalingConfig(num_workers=2).elasticity_enabled
    with pytest.raises(ValueError, match=r"`use_gpu` is False but `GPU` was found in `resources_per_worker`. Either "
                                         r"set `use_gpu` to True or remove `GPU` from `resources_per_worker`."):
        ScalingConfig(use_gpu=False, resources_per_worker={"GPU": 1})
    with pytest.raises(ValueError, match=r"`use_gpu` is True but `GPU` is set to 0 in `resources_per_worker`"):
        ScalingConfig(use_gpu=True, resources_per_worker={"GPU": 0})
    with pytest.raises(ValueError, match=r"the keys are case-sensitive \(as in Ray Train\): use 'CPU', not 'cpu'"):
        ScalingConfig(resources_per_worker={"cpu": 2})
    with pytest.raises(ValueError, match=r"reserves 'CPU' and 'GPU' per worker only \('memory': memory and custom"):
        ScalingConfig(resources_per_worker={"CPU": 1, "memory": 1e9})
    with pytest.raises(TypeError, match=r"resources_per_worker=...\) expects None or a dict .*got dict"):
        ScalingConfig(resources_per_worker={"CPU": -1})
    with pytest.raises(DeprecationWarning, match=r"`ScalingConfig\(trainer_resources\)` is deprecated"):
        ScalingConfig(trainer_resources={"CPU": 1})
    with pytest.raises(NotImplementedError, match=r"ScalingConfig\(use_tpu=True\) is not supported by raysgd.train"):
        ScalingConfig(use_tpu=True)
    with pytest.raises(NotImplementedError, match=r"accelerator_type='A100'\) is not supported"):
        ScalingConfig(accelerator_type="A100")
    with pytest.raises(ValueError, match=r"elastic_resize_monitor_interval_s=...\) expects a number of seconds >= 0"):
        ScalingConfig(elastic_resize_monitor_interval_s=-1)


def test_a_worker_that_reserves_no_resource_is_refused_by_the_scaling_config():
    # it was accepted, and fit() failed with "the training function raised (ValueError: Bundles cannot be an empty
    # dictionary or resources with only 0 values ...)" from Ray's placement group
    for resources in ({"CPU": 0}, {"CPU": 0, "GPU": 0}, {"CPU": np.float64(0.0)}):
        with pytest.raises(ValueError, match=r"a worker must reserve a 'CPU' or a 'GPU' amount above 0"):
            ScalingConfig(num_workers=2, resources_per_worker=resources)
    assert ScalingConfig(resources_per_worker={"CPU": 0.5}).num_cpus_per_worker == 0.5
    assert ScalingConfig(use_gpu=True, resources_per_worker={"CPU": 0}).num_gpus_per_worker == 1


def test_failure_checkpoint_and_run_configs_have_ray_2_58s_fields_and_deprecations():
    failure = FailureConfig(max_failures=3, controller_failure_limit=0, max_preemption_failures=5)
    assert (failure.max_failures, failure.controller_failure_limit, failure.max_preemption_failures) == (3, 0, 5)
    assert (FailureConfig().controller_failure_limit, FailureConfig().max_preemption_failures) == (-1, -1)
    with pytest.raises(DeprecationWarning, match=r"`FailureConfig\(fail_fast\)` is deprecated"):
        FailureConfig(fail_fast=True)
    with pytest.raises(TypeError, match=r"FailureConfig\(max_preemption_failures=...\) expects an int >= -1"):
        FailureConfig(max_preemption_failures=-2)
    for name in ("checkpoint_frequency", "checkpoint_at_end"):
        with pytest.raises(DeprecationWarning, match=f"`{name}` is deprecated since it does not apply to user-defined "
                                                     f"training functions"):
            CheckpointConfig(**{name: None})
    assert CheckpointConfig(checkpoint_score_attribute="acc").checkpoint_score_order == "max"
    with pytest.raises(ValueError, match=r"checkpoint_score_order=...\) expects 'max' or 'min'; got str 'best'"):
        CheckpointConfig(checkpoint_score_order="best")
    with pytest.raises(ValueError, match=r"num_to_keep=...\) expects None or an int >= 1; got int 0"):
        CheckpointConfig(num_to_keep=0)
    with pytest.raises(TypeError, match=r"checkpoint_score_attribute=...\) expects None or a metric's name"):
        CheckpointConfig(checkpoint_score_attribute=3)
    for name in ("sync_config", "verbose", "stop", "progress_reporter", "log_to_file"):
        with pytest.raises(DeprecationWarning, match=rf"`RunConfig\({name}\)` is deprecated"):
            RunConfig(**{name: None})  # None too: any value given is refused, as in Ray Train 2.58
    with pytest.raises(NotImplementedError, match=r"storage_filesystem=.*pass the location as a URI in storage_path"):
        RunConfig(storage_filesystem=object())
    with pytest.raises(NotImplementedError, match=r"RunConfig\(worker_runtime_env=\{'pip': \['x'\]\}\)"):
        RunConfig(worker_runtime_env={"pip": ["x"]})
    assert RunConfig(worker_runtime_env={}).worker_runtime_env == {}
    assert RunConfig(logging_config=LoggingConfig("debug")).logging_config.log_level == "DEBUG"
    assert RunConfig().logging_config.log_level is None  # raysgd's level as it is (Ray Train's default: "INFO")
    with pytest.raises(ValueError, match=r"LoggingConfig\(log_level=...\) expects one of"):
        LoggingConfig("loud")
    # the names raysgd.set_log_level takes (fit() hands the level to it), on Python 3.10 too (no
    # logging.getLevelNamesMapping there): "fatal" and "notset" were accepted here, then refused by fit()
    assert [LoggingConfig(name).log_level for name in ("warn", "critical", "off")] == ["WARN", "CRITICAL", "OFF"]
    for name in ("fatal", "notset"):
        with pytest.raises(ValueError, match=r"LoggingConfig\(log_level=...\) expects one of"):
            LoggingConfig(name)


def test_a_training_function_that_cannot_be_called_fn_config_or_fn_is_refused_before_fit():
    """A function of two required arguments (or a required keyword-only one) raised TypeError on every worker,
    retried under FailureConfig; Ray Train refuses it (ValueError) before any worker starts."""
    from functools import partial

    from raysgd.train.torch import TorchTrainer

    def two(model, config):
        return model, config

    with pytest.raises(ValueError, match=r"TorchTrainer\(train_loop_per_worker=...\) expects a function fn\(config\) "
                                         r"or fn\(\) \(0 or 1 required arguments, as in Ray Train\); got .*two, which "
                                         r"takes 2 required arguments \(model, config\)"):
        TorchTrainer(two)
    with pytest.raises(ValueError, match=r"takes the required keyword-only argument config"):
        TorchTrainer(lambda *, config: None)
    for fine in (partial(two, None), lambda config, lr=0.1, *args, **kwargs: None, lambda: None, print):
        assert TorchTrainer(fine).train_loop_per_worker is fine


def test_numpy_numbers_in_the_configs_are_kept_as_pythons_and_an_endless_timeout_is_refused():
    """numpy's scalars pass the configs' checks; kept as numpy, a np.int64 timeout_s failed in every worker
    (datetime.timedelta refuses it) and a np.int64 num_to_keep failed the retention's check (no checkpoint pruned)."""
    import datetime

    from raysgd.train.torch import TorchConfig

    timeout = TorchConfig(timeout_s=np.int64(60)).timeout_s
    assert type(timeout) is int and datetime.timedelta(seconds=timeout) == datetime.timedelta(minutes=1)
    keep_one = CheckpointConfig(num_to_keep=np.int64(1))
    assert type(keep_one.num_to_keep) is int
    assert checkpoints_to_delete([(1, {}), (2, {}), (3, {})], keep_one) == [1, 2]
    assert type(FailureConfig(max_failures=np.int64(3)).max_failures) is int
    scaling = ScalingConfig(num_workers=np.int64(2), resources_per_worker={"CPU": np.float32(0.5)},
                            num_spares=np.int64(1))
    assert (scaling.num_workers, scaling.resources_per_worker, scaling.num_spares) == (2, {"CPU": 0.5}, 1)
    assert [type(v) for v in (scaling.num_workers, scaling.resources_per_worker["CPU"], scaling.num_spares)] == \
        [int, float, int]
    assert ScalingConfig(num_workers=[1, np.int64(3)]).num_workers == (1, 3)
    for endless in (float("inf"), 1e300):
        with pytest.raises(ValueError, match=r"TorchConfig\(timeout_s=...\) expects a finite number of seconds"):
            TorchConfig(timeout_s=endless)


def test_get_dataset_shard_and_torch_config_take_ray_trains_argument_names_and_order():
    """get_dataset_shard(dataset_name="train") (Ray Train's keyword) raised TypeError; TorchConfig's positional
    order is Ray Train's (backend, init_method, timeout_s)."""
    from raysgd.train.session import Session, TrainContext, running
    from raysgd.train.torch import TorchConfig

    context = TrainContext(world_size=1, world_rank=0, local_rank=0, local_world_size=1, node_rank=0,
                           experiment_name="exp", storage_path="/tmp")
    shards = {"train": object(), "val": object()}
    with running(Session(context, torch.device("cpu"), dataset_shards=shards)):
        assert raysgd.train.get_dataset_shard(dataset_name="val") is shards["val"]
        assert raysgd.train.get_dataset_shard() is raysgd.train.get_dataset_shard(dataset_name=None) is shards["train"]
        with pytest.raises(KeyError, match=r"get_dataset_shard\('test'\): no dataset .* it has \['train', 'val'\]"):
            raysgd.train.get_dataset_shard(dataset_name="test")
    config = TorchConfig("gloo", "tcp", 60)
    assert (config.backend, config.init_method, config.timeout_s) == ("gloo", "tcp", 60)
    with pytest.raises(ValueError, match=r"TorchConfig\(init_method=...\) expects 'env' or 'tcp'"):
        TorchConfig(init_method="file:///tmp/rendezvous")


def test_resume_from_a_checkpoint_without_a_uri_is_refused_before_fit(tmp_path):
    """A Checkpoint(path, filesystem=<remote filesystem object>) has no URI: the workers were handed None to open
    (get_checkpoint() raised TypeError on each); the constructor refuses it, naming resume_from_checkpoint."""
    import pyarrow.fs

    from raysgd.train.torch import TorchTrainer

    remote = Checkpoint("ckpt", filesystem=pyarrow.fs.SubTreeFileSystem(str(tmp_path), pyarrow.fs.LocalFileSystem()))
    assert remote.uri is None
    with pytest.raises(ValueError, match=r"TorchTrainer\(resume_from_checkpoint=...\) expects a Checkpoint the workers "
                                         r"can open: .*; got Checkpoint\(filesystem=subtree, path=ckpt\), made from a "
                                         r"path inside a filesystem object \(no URI\)"):
        TorchTrainer(lambda: None, resume_from_checkpoint=remote)
    for fine in (Checkpoint(str(tmp_path)), Checkpoint(str(tmp_path), filesystem=pyarrow.fs.LocalFileSystem())):
        assert TorchTrainer(lambda: None, resume_from_checkpoint=fine).resume_from_checkpoint is fine


def test_an_empty_storage_path_is_refused_not_taken_for_the_filesystems_root(tmp_path):
    """RunConfig(storage_path="") put the run folder at "/<name>" (the filesystem's root); Ray Train refuses it."""
    with pytest.raises(ValueError, match=r"RunConfig\(storage_path=...\) expects None or a non-empty folder path or "
                                         r"URI; got str ''"):
        RunConfig(name="exp", storage_path="")
    with pytest.raises(TypeError, match=r"RunConfig\(storage_path=...\) expects None, a folder path or a URI"):
        RunConfig(storage_path=b"/tmp")
    assert RunConfig(storage_path=tmp_path).storage_path == str(tmp_path)


# ------------------------------------------------------------------------------------------------ retention policy
def test_checkpoints_are_kept_by_age_or_by_score_and_the_latest_is_never_deleted():
    entries = [(1, {"acc": 0.5}), (2, {"acc": 0.9}), (3, {"acc": 0.7}), (4, {"acc": 0.2})]
    assert checkpoints_to_delete(entries, None) == [] and checkpoints_to_delete([], CheckpointConfig(1)) == []
    assert checkpoints_to_delete(entries, CheckpointConfig(num_to_keep=2)) == [1, 2]
    assert checkpoints_to_delete(entries, CheckpointConfig(num_to_keep=5)) == []
    by_max = CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="acc")
    assert checkpoints_to_delete(entries, by_max) == [1]  # 4 scores worst but is the restart point
    assert [i for i, _ in best(entries, by_max)] == [3, 2]  # worst first, best last
    by_min = CheckpointConfig(num_to_keep=1, checkpoint_score_attribute="acc", checkpoint_score_order="min")
    assert checkpoints_to_delete(entries, by_min) == [1, 2, 3] and [i for i, _ in best(entries, by_min)] == [4]
    assert checkpoints_to_delete(entries + [(5, {"acc": 0.95})], by_max) == [1, 3, 4]
    ties = [(1, {"acc": 1}), (2, {"acc": 1}), (3, {"acc": 1}), (4, {"acc": 0})]
    assert checkpoints_to_delete(ties, CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="acc")) == [1]
    nested = [(1, {"val": {"acc": 0.9}}), (2, {"val": {"acc": 0.1}}), (3, {"val": {"acc": 0.5}})]
    assert checkpoints_to_delete(nested, CheckpointConfig(num_to_keep=1, checkpoint_score_attribute="val/acc")) == [2]


def test_a_missing_or_nan_score_ranks_worst_and_a_non_numeric_one_is_refused(caplog):
    entries = [(1, {"loss": 0.1}), (2, {"other": 1}), (3, {"loss": float("nan")}), (4, {"loss": 0.5})]
    for order in ("min", "max"):
        config = CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="loss", checkpoint_score_order=order)
        with caplog.at_level(logging.ERROR):
            assert checkpoints_to_delete(entries, config) == [2, 3]
    assert "have no 'loss'" in caplog.text and "['other']" in caplog.text
    with pytest.raises(ValueError, match=r"checkpoint_score_attribute='loss'\) needs a number in the metrics reported "
                                         r"with each checkpoint; got str 'low'"):
        checkpoints_to_delete([(1, {"loss": "low"}), (2, {"loss": 1})], CheckpointConfig(1, "loss"))
    with pytest.raises(ValueError, match=r"got NoneType None"):
        check_score({"loss": None}, "loss")
    with pytest.raises(ValueError, match=r"got complex64"):  # a complex score: float() would drop its imaginary part
        check_score({"loss": np.complex64(1 + 1j)}, "loss")
    check_score({"loss": np.float32(0.5)}, "loss")  # numpy's real numbers are numbers
    check_score({"other": 1}, "loss")  # missing: logged when ranked, not refused
    check_score({"loss": "x"}, None)  # no score attribute: nothing to check


# ------------------------------------------------------------------------------------------ the table of ray.train
def ray_public_names():
    """``{"ray.train.X": ...}`` of the installed Ray's public names (``__all__``) of the modules the table covers."""
    names = []
    for module in ("ray.train", "ray.train.torch", "ray.train.collective", "ray.train.lightning"):
        names += [f"{module}.{name}" for name in importlib.import_module(module).__all__]
    return names + [f"ray.train.{framework}" for framework in ("tensorflow", "xgboost", "lightgbm", "huggingface",
                                                               "horovod")]


def table_rows():
    """``{ray name: (status, raysgd name or None)}`` of docs/coming-from-ray-train.md's table."""
    rows = {}
    for line in open(TABLE).read().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`ray.train"):
            continue
        raysgd_name = re.fullmatch(r"`(raysgd[\w.]*)`", cells[2])
        for name in re.findall(r"`(ray\.train[\w.]*)`", cells[0]):
            rows[name] = (cells[1], raysgd_name.group(1) if raysgd_name else None)
    return rows


def resolve(dotted):
    """The object a dotted raysgd name names (a module, or an attribute of one), else raises."""
    module, _, attribute = dotted.rpartition(".")
    try:
        return importlib.import_module(dotted)
    except ImportError:
        return getattr(importlib.import_module(module), attribute)


def test_the_coming_from_ray_train_table_lists_every_public_ray_train_name_truly():
    """Every public name of ray.train, ray.train.torch, ray.train.collective and ray.train.lightning (the installed
    Ray's) has a row; a row that says it works names the raysgd object, which exists; a missing one is refused."""
    rows = table_rows()
    assert sorted(set(ray_public_names()) - set(rows)) == [], "names the table does not list"
    statuses = {"works", "works differently", "missing"}
    assert {status for status, _ in rows.values()} <= statuses, rows
    for name, (status, raysgd_name) in rows.items():
        if status == "missing":
            counterpart = "raysgd" + name[len("ray"):]
            with pytest.raises((ImportError, AttributeError)):
                resolve(counterpart)
        else:
            assert raysgd_name is not None, f"{name}: a row that works names its raysgd counterpart"
            resolve(raysgd_name)


# ------------------------------------------------------------------------ in training functions, on a real cluster
@pytest.fixture(scope="module")
def cluster(ray_2cpus):
    return ray_2cpus


def collective_loop(config):
    """Every rank: broadcasts (rank 0's data wins), a barrier, two refused broadcasts (too big, unpicklable) and
    one after them, two reports and ``get_all_reported_checkpoints``; what it saw goes to ``out/rank<r>.json``."""
    import threading  # noqa: PLC0415

    from raysgd.train.collective import barrier, broadcast_from_rank_zero  # noqa: PLC0415

    rank = raysgd.train.get_context().get_world_rank()
    seen = {"config": broadcast_from_rank_zero({"seed": 7, "from": rank} if rank == 0 else {"from": rank}),
            "none": broadcast_from_rank_zero(None)}
    barrier()
    for name, data in (("too_big", "x" * 2000), ("unpicklable", threading.Lock())):
        try:
            broadcast_from_rank_zero(data if rank == 0 else None)
        except Exception as err:  # noqa: BLE001 (what each rank raised is what the test checks)
            seen[name] = f"{type(err).__name__}: {err}"
    seen["after"] = broadcast_from_rank_zero(10 + rank)  # the group still works after the refused ones
    for step in range(2):
        with tempfile.TemporaryDirectory() as folder:
            with open(os.path.join(folder, "state"), "w") as handle:
                handle.write(str(step))
            raysgd.train.report({"step": step, "loss": 1.0 / (step + 1)}, checkpoint=Checkpoint.from_directory(folder))
    seen["reported"] = [(os.path.basename(r.checkpoint.path), r.metrics, isinstance(r, ReportedCheckpoint))
                        for r in raysgd.train.get_all_reported_checkpoints()]
    with open(os.path.join(config["out"], f"rank{rank}.json"), "w") as handle:
        json.dump(seen, handle)


@pytest.mark.parametrize("workers", [2, 1])
def test_collectives_and_reported_checkpoints_inside_a_training_function(cluster, tmp_path, workers):
    from raysgd.train.torch import TorchConfig, TorchTrainer

    TorchTrainer(collective_loop, train_loop_config={"out": str(tmp_path)}, torch_config=TorchConfig(timeout_s=30),
                 scaling_config=ScalingConfig(num_workers=workers),
                 run_config=RunConfig(name="collective", storage_path=str(tmp_path / "runs"))).fit()
    for rank in range(workers):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["config"] == {"seed": 7, "from": 0} and seen["none"] is None and seen["after"] == 10
        assert seen["too_big"].startswith("ValueError: raysgd.train.collective.broadcast_from_rank_zero: rank 0's "
                                          "data is ") and "the limit is 1000 bytes" in seen["too_big"]
        assert seen["unpicklable"].startswith("TypeError: "), seen["unpicklable"]
        assert seen["reported"] == [["checkpoint_000001", {"step": 0, "loss": 1.0}, True],
                                    ["checkpoint_000002", {"step": 1, "loss": 0.5}, True]], seen["reported"]
    from raysgd.train.collective import barrier, broadcast_from_rank_zero

    for outside in (barrier, lambda: broadcast_from_rank_zero(1), raysgd.train.get_all_reported_checkpoints):
        with pytest.raises(RuntimeError, match="works only inside the training function"):
            outside()


def lightning_fsdp_loop(config):
    """A Lightning Trainer with RayFSDPStrategy on every rank: what the strategy sees, then its fit (one epoch)."""
    import lightning.pytorch as pl  # noqa: PLC0415
    from torch.utils.data import DataLoader, TensorDataset  # noqa: PLC0415

    from raysgd.train.lightning import (RayFSDPStrategy, RayLightningEnvironment,  # noqa: PLC0415
                                        RayTrainReportCallback, prepare_trainer)
    from raysgd.train.torch import get_device  # noqa: PLC0415

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, index):
            loss = torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    strategy = RayFSDPStrategy()
    trainer = prepare_trainer(pl.Trainer(
        max_epochs=1, devices="auto", accelerator="auto", strategy=strategy, plugins=[RayLightningEnvironment()],
        callbacks=[RayTrainReportCallback()], enable_checkpointing=False, logger=False, enable_progress_bar=False,
        enable_model_summary=False))
    rank = raysgd.train.get_context().get_world_rank()
    seen = {"root_device": str(strategy.root_device), "device": str(get_device()),
            "sampler": strategy.distributed_sampler_kwargs, "fsdp": isinstance(strategy, pl.strategies.FSDPStrategy)}
    try:
        trainer.fit(Tiny(), DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=4))
        seen["fit"] = "trained"
    except RuntimeError as err:
        seen["fit"] = str(err)
    with open(os.path.join(config["out"], f"rank{rank}.json"), "w") as handle:
        json.dump(seen, handle)


def run_lightning_fsdp(tmp_path, workers, use_gpu):
    from raysgd.train.torch import TorchConfig, TorchTrainer

    return TorchTrainer(lightning_fsdp_loop, train_loop_config={"out": str(tmp_path)},
                        scaling_config=ScalingConfig(num_workers=workers, use_gpu=use_gpu),
                        torch_config=TorchConfig(timeout_s=60),
                        run_config=RunConfig(name="fsdp", storage_path=str(tmp_path / "runs"))).fit()


def test_ray_fsdp_strategy_is_lightnings_fsdp_on_the_worker_groups_ranks_and_device(cluster, tmp_path):
    """2 CPU workers: prepare_trainer accepts RayFSDPStrategy, which takes each worker's device and rank; the fit
    itself stops where torch's FSDP refuses a CPU (as it does under Ray Train), on every rank alike."""
    pytest.importorskip("lightning.pytorch", reason="needs Lightning (the test extra)")
    run_lightning_fsdp(tmp_path, 2, use_gpu=False)
    for rank in range(2):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["fsdp"] and seen["root_device"] == seen["device"] == "cpu"
        assert seen["sampler"] == {"num_replicas": 2, "rank": rank}
        assert "FSDP needs a non-CPU accelerator device" in seen["fit"], seen["fit"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's FSDP needs an accelerator: this runs on CUDA only")
def test_ray_fsdp_strategy_trains_on_a_cuda_worker_and_reports_lightnings_checkpoint(cluster, tmp_path):
    pytest.importorskip("lightning.pytorch", reason="needs Lightning (the test extra)")
    result = run_lightning_fsdp(tmp_path, 1, use_gpu=True)
    seen = json.loads((tmp_path / "rank0.json").read_text())
    assert seen["fit"] == "trained" and seen["root_device"] == seen["device"] == "cuda:0"
    assert result.checkpoint is not None and "checkpoint.ckpt" in os.listdir(result.checkpoint.path)
