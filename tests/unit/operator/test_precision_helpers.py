"""The precision helpers in one process: clipping in backward_and_step (raysgd.torch.operator.precision)."""
import copy
import pickle

import numpy as np
import pytest
import torch

from raysgd.torch.operator.precision import LegacyAmp, Precision, PrecisionHelpers


class Helpers(PrecisionHelpers):
    def __init__(self, precision):
        self._precision = precision


def one_step(clip_grad_norm, precision=None):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.ones(4, 2)
    Helpers(precision or Precision(False)).backward_and_step((model(x) ** 2).mean(), optimizer,
                                                             clip_grad_norm=clip_grad_norm)
    return (model(x) ** 2).mean().item()


@pytest.mark.parametrize("clip_grad_norm", [-1.0, float("nan"), "1.0", True])
def test_a_clip_grad_norm_that_is_no_number_of_0_or_more_is_refused(clip_grad_norm):
    """A negative norm flipped the gradients (the loss went up), silently."""
    with pytest.raises(ValueError, match=r"backward_and_step: clip_grad_norm expects a number >= 0 \(0 or None"):
        one_step(clip_grad_norm)


def test_a_clip_grad_norm_of_0_clips_nothing_and_a_tensor_one_clips():
    """0 zeroed every gradient (no training, silently): as Lightning's gradient_clip_val=0 it now clips nothing."""
    assert one_step(0) == pytest.approx(one_step(None))
    assert one_step(None) < one_step(torch.tensor(1e-3))  # a small norm slows the step
    assert one_step(torch.tensor(1e-3)) == pytest.approx(one_step(1e-3))


def test_clipping_takes_numpy_numbers_and_unscales_first():
    unclipped = one_step(None)
    assert one_step(np.float64(1e6)) == pytest.approx(unclipped)  # a norm above the gradient's changes nothing
    assert one_step(np.float32(1e-3)) > unclipped  # a small one slows the step
    scaled = Precision(False)
    scaled.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)  # an enabled scaler, as fp16 on CUDA has
    assert one_step(1e-3, scaled) == pytest.approx(one_step(1e-3))  # clipped after unscaling: the same step


def test_the_1x_amp_object_can_be_copied_and_pickled():
    """``copy.deepcopy(self._amp)`` (a 1.x loop keeping a copy of its operator's parts) recursed until
    ``RecursionError``: the copy's ``__getattr__`` read ``_precision`` before it was set."""
    amp = LegacyAmp(Precision(False))
    for copied in (copy.deepcopy(amp), pickle.loads(pickle.dumps(amp))):
        with copied.autocast():
            pass
        with pytest.raises(AttributeError):
            copied.scale_loss  # no apex: as on the original
