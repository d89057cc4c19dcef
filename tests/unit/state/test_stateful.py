"""The one ``Stateful`` protocol: every component a checkpoint holds saves and restores itself, and storage writes the
states it is given without calling into them."""
import json
import os
import random

import numpy as np
import pytest
import torch

from raysgd.base.stateful import Stateful, check_components, load_state_dicts, state_dicts
from raysgd.callbacks import Callback, CallbackList
from raysgd.torch.integrations.results import ResultLogger, read_results
from raysgd.torch.sharding.cursor import DataCursor
from raysgd.torch.state.checkpoint import state_to_bytes
from raysgd.torch.state.training_state import RandomStreams
from raysgd.torch.storage import durable


class Counter(Callback):
    def __init__(self):
        self.count = 0

    def on_train_result(self, trainer, result):
        self.count += 1

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def test_the_components_a_checkpoint_holds_are_stateful(tmp_path):
    log = ResultLogger(str(tmp_path), tensorboard=False)
    for component in (CallbackList([Counter()]), Callback(), log, RandomStreams()):
        assert isinstance(component, Stateful), type(component).__name__
    assert not isinstance(object(), Stateful)


def test_a_named_mapping_saves_and_restores_in_order_and_skips_missing_states(tmp_path):
    log = ResultLogger(str(tmp_path), tensorboard=False)
    callbacks = CallbackList([Counter()])
    for loss in (3, 2, 1):
        log.log("train", {"train_loss": loss})
        callbacks.call("on_train_result", None, {})
    components = {"result_rows": log, "callback_state": callbacks}
    saved = json.loads(json.dumps(state_dicts(components)))  # JSON-able: they go into a marker
    assert saved == {"result_rows": {"train_rows": 3}, "callback_state": {"0:Counter": {"count": 3}}}
    fresh = CallbackList([Counter()])
    assert load_state_dicts({"result_rows": log, "callback_state": fresh},
                            {"result_rows": {"train_rows": 1}, "callback_state": saved["callback_state"]}) \
        == ["result_rows", "callback_state"]
    assert fresh.callbacks[0].count == 3
    assert [row["train_loss"] for row in read_results(log.logdir)] == [3]
    assert load_state_dicts(components, {"callback_state": None}) == []  # nothing saved: left as it is


def test_bad_components_name_the_argument():
    with pytest.raises(TypeError, match=r"RunController: components expects a mapping of names to Stateful"):
        check_components({"log": object()}, "RunController")
    with pytest.raises(TypeError, match="components expects a mapping"):
        state_dicts([Counter()])


def test_the_result_log_reads_the_older_marker_form(tmp_path):
    log = ResultLogger(str(tmp_path), tensorboard=False)
    for loss in (3, 2, 1):
        log.log("train", {"train_loss": loss})
    log.load_state_dict(2)  # markers of earlier versions: result_rows was the row count alone
    assert log.state_dict() == {"train_rows": 2} and len(read_results(log.logdir)) == 2
    with pytest.raises(TypeError, match=r"ResultLogger.load_state_dict\(state=...\) expects"):
        log.load_state_dict({"rows": 1})


def test_random_streams_save_and_restore_every_stream():
    streams = RandomStreams()
    saved = streams.state_dict()
    drawn = (torch.rand(2), np.random.rand(), random.random())
    streams.load_state_dict(saved)
    again = (torch.rand(2), np.random.rand(), random.random())
    assert torch.equal(drawn[0], again[0]) and drawn[1:] == again[1:]
    streams.load_state_dict(None)  # nothing saved: the streams go on


def test_durable_run_writes_the_states_it_is_handed_and_resume_returns_them(tmp_path):
    path = str(tmp_path / "run")
    run = durable.open_run(path, num_to_keep=2, resume=True)
    state = {"epoch": 1, "models": [], "optimizers": [], "operator": None}
    run.on_result("train", {"epoch": 1}, state_to_bytes(state), states={"callback_state": {"0:Counter": {"n": 1}}})
    with pytest.raises(ValueError, match=r"DurableRun.submit\(states=...\) expects names apart"):
        run.submit(state_to_bytes(state), states={"epoch": 2}, epoch=2)
    run.close()
    again = durable.open_run(path, num_to_keep=2, resume=True)
    restored = again.resume(lambda directory, marker: None, timeout_s=60)
    again.close()
    assert restored.marker["callback_state"] == {"0:Counter": {"n": 1}} and restored.marker["epoch"] == 1
    assert os.path.isdir(restored.path)


def test_the_data_cursor_saves_and_checks_what_it_loads():
    cursor = DataCursor(3, 24, 3, 5, attempt=1, call="run/7")
    assert isinstance(cursor, Stateful)
    state = cursor.state_dict()
    assert state == {"epoch": 3, "consumed": 24, "steps": 3, "call_steps": 5, "attempt": 1, "call": "run/7"}
    assert DataCursor.of(state).state_dict() == state
    with pytest.raises(ValueError, match="DataCursor: steps expects an int >= 0; got None"):
        DataCursor.of({"epoch": 3, "consumed": 24})
    with pytest.raises(TypeError, match="DataCursor: state expects a dict"):
        cursor.load_state_dict([3, 24, 3])
