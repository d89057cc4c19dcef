"""raysgd.callbacks' CallbackList in one process (no Ray): the callbacks' states as a checkpoint's marker keeps them.

The hooks on a real run are tested in tests/cluster/integrations/test_callbacks.py.
"""
import json
import logging

import numpy as np
import torch

from raysgd.callbacks import Callback, CallbackList
from raysgd.torch.storage import filesystem


class Best(Callback):
    """Keeps the best loss and its epoch, as numpy and torch hand them out."""

    def __init__(self):
        self.best, self.epoch, self.loaded = None, None, None

    def state_dict(self):
        return {"best": np.float32(0.25), "epoch": np.int64(3), "seen": (np.int32(1), torch.tensor(2.5)),
                "improved": np.bool_(True), "name": "val_loss"}

    def load_state_dict(self, state):
        self.loaded = state


class Weights(Callback):
    def state_dict(self):
        return {"w": torch.ones(3)}


class MixedKeys(Callback):
    def state_dict(self):
        return {1: "a", "b": 2}


def through_a_marker(states):
    """What a resumed run reads back: the state as the checkpoint's marker stores it."""
    return json.loads(filesystem.marker_text({"epoch": 1, "callback_state": states}))["callback_state"]


def test_numpy_and_torch_numbers_in_a_callbacks_state_come_back_as_numbers():
    saved = through_a_marker(CallbackList([Best()]).state_dict())
    fresh = Best()
    CallbackList([fresh]).load_state_dict(saved)
    # they came back as their repr: 'np.float32(0.25)', 'np.int64(3)', 'tensor(2.5000)'
    assert fresh.loaded == {"best": 0.25, "epoch": 3, "seen": [1, 2.5], "improved": True, "name": "val_loss"}


def test_a_state_json_cannot_hold_is_named_and_not_saved_and_the_others_are(caplog):
    with caplog.at_level(logging.WARNING, logger="raysgd.callbacks"):
        states = CallbackList([Weights(), MixedKeys(), Best()]).state_dict()
    assert list(states) == ["2:Best"]
    through_a_marker(states)  # MixedKeys' state made the marker's json.dumps raise TypeError: no checkpoint
    assert "Callback Weights.state_dict returned what JSON cannot hold (TypeError" in caplog.text
    assert "Callback MixedKeys.state_dict returned what JSON cannot hold (TypeError" in caplog.text


def test_a_hook_set_on_the_instance_is_called_and_the_base_no_ops_are_not():
    from raysgd.train.callback import UserCallback, UserCallbacks

    seen = []
    quick = Callback()  # a hook given as a function, without a subclass: it was skipped as the base class's no-op
    quick.on_train_result = lambda trainer, result: seen.append(("train", result["loss"]))
    quick.rewind = lambda: seen.append("rewind")
    callbacks = CallbackList([quick, Callback(), Best()])
    callbacks.call("on_train_result", None, {"loss": 0.5})
    callbacks.call("on_shutdown", None)
    callbacks.rewind()
    reports = UserCallback()
    reports.after_report = lambda context, metrics, checkpoint: seen.append(("report", metrics[0]["loss"]))
    UserCallbacks([reports, UserCallback()]).after_report(None, [{"loss": 0.25}], None)
    assert seen == [("train", 0.5), "rewind", ("report", 0.25)]
