"""A helper module of a RaySGD 1.x program: Ray workers import it by name, so they need the mapping too."""
import os

from ray.util.sgd.torch.training_operator import TrainingOperator
from ray.util.sgd.utils import NUM_SAMPLES


def describe_process():
    return {"pid": os.getpid(), "operator_module": TrainingOperator.__module__, "num_samples_key": NUM_SAMPLES}
