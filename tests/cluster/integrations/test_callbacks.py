"""Driver-side callbacks on a real Ray cluster: every hook, in order; a raising callback is logged and skipped;
failures, resizes and durable checkpoints reach the hooks; a callback's state survives a resumed durable run."""
import json
import logging
import os
import time

import pytest
import ray

from conftest import REPO_DIR
from helpers import FaultyOperator, LinearOperator
from raysgd import Callback, TorchTrainer
from raysgd.callbacks import CallbackList

pytestmark = pytest.mark.usefixtures("ray_4cpus")

CONFIG = {"lr": 0.01, "data_size": 40, "batch_size": 10}


class Recorder(Callback):
    """Records every hook it hears as ``(hook, detail)``."""

    def __init__(self):
        self.events = []
        self.loaded = None

    def on_train_result(self, trainer, result):
        self.events.append(("train", result["epoch"]))

    def on_validate_result(self, trainer, result):
        self.events.append(("validate", result["num_samples"]))

    def on_checkpoint(self, trainer, path):
        self.events.append(("checkpoint", path))

    def on_failure(self, trainer, failure):
        self.events.append(("failure", (failure.method, failure.retry, failure.max_retries, failure.gave_up)))

    def on_resize(self, trainer, old, new):
        self.events.append(("resize", (old, new)))

    def on_shutdown(self, trainer):
        self.events.append(("shutdown", trainer.num_failures))

    def state_dict(self):
        return {"results": sum(1 for hook, _ in self.events if hook == "train")}

    def load_state_dict(self, state):
        self.loaded = state

    def hooks(self):
        return [hook for hook, _ in self.events]


class Raising(Callback):
    def on_train_result(self, trainer, result):
        raise RuntimeError("callback bug")

    def on_shutdown(self, trainer):
        raise ValueError("shutdown bug")


@pytest.mark.parametrize("bad, item", [("not a list", None), ([Recorder], "a class"), ([Recorder(), 3], "item 1 is of type int")])
def test_bad_callbacks_are_refused_before_any_actor_starts(bad, item):
    actors = len(ray.util.list_named_actors(all_namespaces=True))
    with pytest.raises(TypeError, match="callbacks expects a list of raysgd.Callback instances") as info:
        TorchTrainer(training_operator_cls=LinearOperator, callbacks=bad)
    if item is not None:
        assert item in str(info.value)
    assert len(ray.util.list_named_actors(all_namespaces=True)) == actors


def test_hooks_run_in_order_and_a_raising_callback_is_logged_and_skipped(trainer_factory, caplog, tmp_path):
    first, last = Recorder(), Recorder()
    trainer = trainer_factory(training_operator_cls=LinearOperator, num_workers=2, config=CONFIG,
                              callbacks=[first, Raising(), last], logdir=str(tmp_path / "logs"))
    with caplog.at_level(logging.WARNING, logger="raysgd.callbacks"):
        assert trainer.train()["epoch"] == 1
        trainer.validate()
        assert trainer.train()["epoch"] == 2  # training goes on after the callback raised
        trainer.shutdown()
    expected = [("train", 1), ("validate", 100), ("train", 2), ("shutdown", 0)]
    assert first.events == expected and last.events == expected  # the one after the raising one still runs
    raised = [r for r in caplog.records if "Raising.on_train_result raised" in r.getMessage()]
    assert len(raised) == 2 and raised[0].exc_info[0] is RuntimeError  # logged with the traceback, each time
    assert any("Raising.on_shutdown raised" in r.getMessage() for r in caplog.records)
    assert trainer.callbacks.callbacks == [] or not trainer.callbacks  # on_shutdown is called once only
    with open(tmp_path / "logs" / "train.csv") as handle:  # logdir is a callback too, before the user's
        assert len(handle.read().splitlines()) == 3


def test_failures_reach_on_failure_recovered_and_given_up(trainer_factory, tmp_path):
    recorder = Recorder()
    fault = {"rank": 1, "batch": 1, "kind": "exit", "marker": str(tmp_path / "fault")}
    trainer = trainer_factory(training_operator_cls=FaultyOperator, num_workers=2, callbacks=[recorder],
                              config=dict(CONFIG, fault=fault))
    assert trainer.train()["epoch"] == 1
    assert ("failure", ("train_epoch", 1, 3, False)) in recorder.events  # recovered: retry 1 of 3
    assert recorder.hooks().index("failure") < recorder.hooks().index("train")
    os.remove(tmp_path / "fault")  # the fault happens again
    with pytest.raises(RuntimeError, match="did not succeed after 0 retries"):
        trainer.train(max_retries=0)
    assert recorder.events[-1] == ("failure", ("train_epoch", 0, 0, True))
    assert trainer.num_failures == 2


def test_a_grow_reaches_on_resize(trainer_factory, monkeypatch):
    monkeypatch.setenv("SGD_RESIZE_COOLDOWN_S", "0")
    hog = ray.util.placement_group([{"CPU": 3}])
    ray.get(hog.ready(), timeout=60)  # 1 CPU left: the range starts at 1 worker
    recorder = Recorder()
    try:
        trainer = trainer_factory(training_operator_cls=LinearOperator, num_workers=(1, 2), callbacks=[recorder],
                                  config=CONFIG)
        assert trainer.worker_group.num_workers == 1
        trainer.train()
    finally:
        ray.util.remove_placement_group(hog)
    deadline = time.monotonic() + 60
    while ray.available_resources().get("CPU", 0) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    trainer.train()  # grows before the call
    assert trainer.worker_group.num_workers == 2
    assert ("resize", (1, 2)) in recorder.events


def test_checkpoints_reach_on_checkpoint_and_the_state_survives_a_resume(trainer_factory, tmp_path):
    storage = tmp_path / "storage"
    recorder = Recorder()
    trainer = trainer_factory(training_operator_cls=LinearOperator, num_workers=2, config=CONFIG,
                              storage_path=str(storage), callbacks=[recorder])
    trainer.train()
    trainer.train()
    trainer.shutdown()  # waits for the last upload
    paths = [detail for hook, detail in recorder.events if hook == "checkpoint"]
    assert paths and all(os.path.exists(os.path.join(p, "checkpoint.json")) for p in paths)
    assert recorder.hooks()[-1] == "shutdown"  # after the last checkpoint
    with open(os.path.join(paths[-1], "checkpoint.json")) as handle:
        assert json.load(handle)["callback_state"] == {"0:Recorder": {"results": 2}}
    again = Recorder()
    resumed = trainer_factory(training_operator_cls=LinearOperator, num_workers=2, config=CONFIG,
                              storage_path=str(storage), callbacks=[again])
    assert again.loaded == {"results": 2}  # handed back before any result
    assert resumed.train()["epoch"] == 3


def test_callback_list_state_is_matched_by_position_and_class():
    recorder = Recorder()
    callbacks = CallbackList([Callback(), recorder])
    callbacks.load_state_dict({"1:Recorder": {"results": 5}, "0:Recorder": {"results": 9}})
    assert recorder.loaded == {"results": 5}
    with pytest.raises(ValueError, match="unknown hook"):
        callbacks.call("on_epoch_end", None)


def test_the_callbacks_benchmark_runs_and_prints_its_table():
    """``benchmarks/callbacks.py --smoke-test`` never rots (speeds are not asserted: the machine is shared)."""
    import subprocess
    import sys

    script = os.path.join(REPO_DIR, "benchmarks", "callbacks.py")
    done = subprocess.run([sys.executable, script, "--smoke-test"], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for row in ("0 no-op callbacks", "100 no-op callbacks", "RayMetrics (the default)", "CSV result log"):
        assert row in done.stdout
