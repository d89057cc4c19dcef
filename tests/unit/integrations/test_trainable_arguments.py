"""TorchTrainer.as_trainable's arguments in one process (no Ray, no trial): what it refuses itself, up front.

A trial built from arguments every trial's TorchTrainer refuses failed only once Tune had reserved its resources,
once per trial and retry. Tune runs are tested in tests/api/test_tune.py.
"""
import pytest

pytest.importorskip("ray.tune")

from raysgd import TorchTrainer, TrainingOperator  # noqa: E402 (after the skip)
from raysgd.torch.integrations.tune import check_trainer_arguments  # noqa: E402


class Operator(TrainingOperator):
    def setup(self, config):
        pass


def test_arguments_every_trial_would_refuse_are_refused_by_as_trainable():
    with pytest.raises(TypeError, match=r"as_trainable: every trial would call TorchTrainer\(...\) with arguments it "
                                        r"cannot take: too many positional arguments"):
        TorchTrainer.as_trainable(Operator, num_workers=1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'num_epoch'"):
        TorchTrainer.as_trainable(training_operator_cls=Operator, num_epoch=3)
    with pytest.raises(TypeError, match="as_trainable: training_operator_cls expects a subclass of "
                                        "raysgd.TrainingOperator; got None"):
        TorchTrainer.as_trainable(num_workers=2)
    with pytest.raises(TypeError, match="as_trainable: config expects a dict or None; got 'lr=0.1'"):
        TorchTrainer.as_trainable(training_operator_cls=Operator, config="lr=0.1")
    with pytest.raises(ValueError, match="as_trainable: timeout_s expects a number of seconds > 0"):
        TorchTrainer.as_trainable(training_operator_cls=Operator, timeout_s=-1)


def test_what_a_tune_config_may_change_and_a_trainer_of_its_own_are_left_to_the_trial():
    # a batch size two workers cannot split: the Tune config may set another (config is merged in each trial)
    TorchTrainer.as_trainable(training_operator_cls=Operator, num_workers=2, config={"batch_size": 1})

    class Custom(TorchTrainer):
        def __init__(self, extra, **kwargs):  # a constructor of its own: only its signature is checked
            super().__init__(**kwargs)

    Custom.as_trainable(extra=1, training_operator_cls=Operator)
    with pytest.raises(TypeError, match=r"every trial would call Custom\(...\) .*missing a required argument: 'extra'"):
        Custom.as_trainable(training_operator_cls=Operator)
    check_trainer_arguments(print, (1, 2), {})  # no signature to read: the trial will tell
