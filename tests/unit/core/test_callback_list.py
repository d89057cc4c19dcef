"""raysgd.callbacks' CallbackList in one process (no Ray): the callbacks' states as a checkpoint's marker keeps them.

The hooks on a real run are tested in tests/cluster/integrations/test_callbacks.py.
"""
import json
import pathlib

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
        return {"w": torch.ones(3), "where": pathlib.Path("/tmp/run"), "best": np.float64(0.5)}


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


def test_a_state_json_cannot_hold_is_kept_in_its_json_form_and_never_fails_the_checkpoint():
    """Keys of mixed types made the marker's ``json.dumps(sort_keys=True)`` raise: the checkpoint failed. A value JSON
    cannot hold comes back as its repr, as before, and the rest of that state as it was."""
    states = CallbackList([Weights(), MixedKeys(), Best()]).state_dict()
    read = through_a_marker(states)
    assert read["0:Weights"] == {"w": repr(torch.ones(3)), "where": "PosixPath('/tmp/run')", "best": 0.5}
    assert read["1:MixedKeys"] == {"1": "a", "b": 2}
    assert read["2:Best"]["epoch"] == 3


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
