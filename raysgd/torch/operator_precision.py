"""The operator's mixed-precision helpers: autocast, scaled backward, steps through the scaler, one scale update.

Layer 2 (torch and layer 1): a mixin of :class:`~raysgd.torch.training_operator.TrainingOperator`, which sets
``self._precision`` (a :class:`~raysgd.torch.precision.Precision`). Custom ``train_batch`` code calls these
so that fp16 on or off is the same code.

Example:
    >>> from raysgd.torch.precision import Precision
    >>> class Helpers(PrecisionHelpers):
    ...     _precision = Precision(False, "cpu")
    >>> with Helpers().autocast():
    ...     pass
"""
import torch


class PrecisionHelpers:
    """``autocast()``, ``backward()``, ``step()``, ``update_scale()``, ``unscale_gradients()``, ``backward_and_step()``.

    Example:
        >>> # in train_batch: with self.autocast(): loss = ...; self.backward_and_step(loss, self.optimizer)
    """

    def autocast(self):
        """Context manager for the forward pass under ``use_fp16`` (a no-op in fp32).

        Example:
            >>> # with self.autocast():
            >>> #     loss = criterion(model(x), y)
        """
        return self._precision.autocast()

    def backward(self, loss, optimizer=None):
        """``loss.backward()``, scaled under fp16 (GradScaler, or apex which needs ``optimizer``)."""
        self._precision.backward(loss, optimizer)

    def step(self, *optimizers, update=True):
        """Step the optimizers through the scaler (skipping inf/NaN steps), then update the scale, which must happen
        once per iteration: with optimizers stepped apart (a GAN) pass ``update=False`` to all but the last."""
        self._precision.step(*optimizers, update=update)

    def update_scale(self):
        """Update the fp16 loss scale once for this iteration (after ``step(..., update=False)``)."""
        self._precision.update_scale()

    def unscale_gradients(self, optimizer):
        """Unscale ``optimizer``'s gradients in place, e.g. before ``clip_grad_norm_``."""
        self._precision.unscale_(optimizer)

    def backward_and_step(self, loss, optimizer, clip_grad_norm=None, update_scale=True):
        """``zero_grad``, scaled backward, optional clipping and the step; ``update_scale=False`` leaves the scale
        update to a later step of the iteration. Example (a GAN's train_batch):
            >>> # self.backward_and_step(d_loss, opt_d, update_scale=False); self.backward_and_step(g_loss, opt_g)
        """
        optimizer.zero_grad()
        self.backward(loss, optimizer)
        if clip_grad_norm is not None:
            self.unscale_gradients(optimizer)
            params = [p for group in optimizer.param_groups for p in group["params"]]
            torch.nn.utils.clip_grad_norm_(params, clip_grad_norm)
        self.step(optimizer, update=update_scale)
