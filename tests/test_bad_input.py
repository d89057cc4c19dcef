"""Bad input a newcomer will try, on a real cluster: refused clearly, before any actor starts where it can be."""
import pytest
import torch

from conftest import assert_released
from raysgd import TorchTrainer, TrainingOperator

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
