"""Bad input a newcomer will try, on a real cluster: refused clearly, before any actor starts where it can be."""
import pickle

import pytest
import torch

from conftest import assert_released
from helpers import LinearOperator
from raysgd import TorchTrainer, TrainingOperator
from raysgd.torch import checkpoint
from raysgd.torch.errors import CheckpointError

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


# ----------------------------------------------------------------- load() of what is not a checkpoint
@pytest.fixture(scope="module")
def trainer():
    made = TorchTrainer(training_operator_cls=LinearOperator, num_workers=1, timeout_s=60,
                        config={"lr": 0.05, "data_size": 32})
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
    from raysgd.torch.worker import TorchWorker

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
    from raysgd.torch import tune as raysgd_tune

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
