"""Fake ``apex.amp``: ``initialize``, ``scale_loss``, ``state_dict``/``load_state_dict``, logged per process.

Each call appends a line ``<pid> <event>`` to ``$FAKE_APEX_LOG`` so tests can count calls per worker.
"""
import contextlib
import os

_state = {"loss_scale": 128.0, "steps": 0}


def _log(event):
    path = os.environ.get("FAKE_APEX_LOG")
    if path:
        with open(path, "a") as handle:
            handle.write(f"{os.getpid()} {event}\n")


def initialize(models, optimizers, **kwargs):
    _log("initialize " + ",".join(f"{k}={v}" for k, v in sorted(kwargs.items())))
    return models, optimizers


@contextlib.contextmanager
def scale_loss(loss, optimizer):
    _log("scale_loss")
    _state["steps"] += 1
    yield loss * 1.0


def state_dict():
    return {"loss_scaler0": dict(_state)}


def load_state_dict(state):
    _log(f"load_state_dict steps={state['loss_scaler0']['steps']}")
    _state.update(state["loss_scaler0"])
