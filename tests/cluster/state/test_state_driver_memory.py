"""The training state never passes through the driver process: a model of 268 MB trained for a few calls, with
its durable checkpoints in ``storage_path``, grows the driver's peak RSS by far less than the model.

The restart point of every call stays in the object store of the workers' node (rank 0 serialises it there) and
the checkpoints are written by a task on that node; only ``get_model()``/``state_dict()``/``save()`` bring the
state to the driver, when the user asks for it.
"""
import pytest

from helpers import WideOperator
from raysgd.torch.storage import filesystem

pytestmark = pytest.mark.usefixtures("ray_2cpus")

WIDTH = 8192  # 8192**2 float32 parameters: 268 MB


def _status(field):
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak_rss():
    """Reset this process's peak RSS (VmHWM) to its current RSS (Linux's ``clear_refs`` 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError as err:
        pytest.skip(f"cannot reset the peak RSS here (/proc/self/clear_refs: {err})")


def test_a_large_model_trains_and_checkpoints_without_the_driver_holding_it(trainer_factory, tmp_path):
    model_bytes = 4 * WIDTH * WIDTH
    path = str(tmp_path / "run")
    trainer = trainer_factory(training_operator_cls=WideOperator, num_workers=2, storage_path=path, num_to_keep=1,
                              config={"width": WIDTH, "data_size": 8, "batch_size": 4})
    trainer.train()  # the first call: the workers' start-up and the first snapshot are behind us
    reset_peak_rss()
    before = _status("VmRSS")
    for _ in range(3):
        trainer.train()
    trainer.validate()
    trainer.shutdown()  # waits for the last checkpoint
    growth = _status("VmHWM") - before
    assert growth < model_bytes / 4, f"the driver's peak RSS grew by {growth / 1e6:.0f} MB (model: " \
                                     f"{model_bytes / 1e6:.0f} MB)"
    newest = filesystem.CheckpointStorage(path).latest()  # written by the workers' side, read here to check it
    assert newest.marker["epoch"] == 4 and newest.marker["size"] > model_bytes
