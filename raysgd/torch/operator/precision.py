"""Mixed precision as one small object: autocast, scaled backward, optimizer step, scaler state.

Layer 1: imports torch only. The default training loop always goes through a :class:`Precision`;
disabled, every method is the plain fp32 operation, so there is one code path and no fp16 branches.
:class:`PrecisionHelpers` is the operator's face of it (a mixin of
:class:`~raysgd.torch.training_operator.TrainingOperator`, which sets ``self._precision``): custom
``train_batch`` code calls ``self.autocast()``, ``self.backward(...)``, ``self.step(...)``, so that fp16 on or
off is the same code.

Modes (``use_fp16``):

* ``False``: fp32, nothing scaled.
* ``True``: float16 autocast and a ``torch.amp.GradScaler`` on CUDA. On CPU float16 autocast is many
  times slower than fp32, so ``True`` keeps fp32 there (as RaySGD 1.x effectively did) and logs once.
* ``"bf16"``: bfloat16 autocast on CPU or CUDA, no scaler (bfloat16 has fp32's exponent range).
* ``"apex"``: NVIDIA apex ``amp.initialize`` and ``amp.scale_loss``; apex is found by import at run time.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> precision = Precision("bf16", torch.device("cpu"))
    >>> with precision.autocast():
    ...     loss = model(torch.ones(4, 2)).float().pow(2).mean()
    >>> precision.backward(loss)
    >>> precision.step(opt)
"""
import contextlib
import logging

import torch

from raysgd.base.checks import expect, is_number

logger = logging.getLogger(__name__)

VALID_FP16 = (False, True, "apex", "bf16")
_warned_cpu_fp16 = False


def validate_fp16(use_fp16):
    """Return ``use_fp16`` if it is one of :data:`VALID_FP16`, else raise ``ValueError``."""
    if use_fp16 is None:
        return False
    if not any(use_fp16 is v or (isinstance(v, str) and use_fp16 == v) for v in VALID_FP16):
        raise ValueError(f"use_fp16 must be one of False, True, 'apex' or 'bf16'; got {use_fp16!r}")
    return use_fp16


def import_apex_amp():
    """Return NVIDIA apex's ``amp`` module, or raise ``ImportError`` saying how to get it."""
    try:
        from apex import amp  # noqa: PLC0415 (optional, found at run time)
    except ImportError as err:
        raise ImportError(
            "use_fp16='apex' needs NVIDIA apex (https://github.com/NVIDIA/apex), which is not importable here. "
            "Note that the PyPI package named 'apex' is unrelated. Use use_fp16=True for torch.amp instead."
        ) from err
    if not hasattr(amp, "initialize") or not hasattr(amp, "scale_loss"):
        raise ImportError("the importable 'apex' has no amp.initialize/amp.scale_loss: it is not NVIDIA apex")
    return amp


class Precision:
    """Owns autocast, loss scaling and the scaler's state for one worker.

    Args:
        mode: ``False``, ``True``, ``"apex"`` or ``"bf16"`` (see the module docstring).
        device: the worker's ``torch.device`` (None means CPU).
    """

    def __init__(self, mode=False, device=None):
        global _warned_cpu_fp16
        self.requested = validate_fp16(mode)
        self.device_type = "cuda" if device is not None and torch.device(device).type == "cuda" else "cpu"
        self.mode = self.requested
        if self.mode is True and self.device_type == "cpu":
            if not _warned_cpu_fp16:
                logger.warning(
                    "use_fp16=True on CPU keeps fp32: float16 autocast is several times slower than fp32 on CPUs. "
                    "Pass use_fp16='bf16' for bfloat16 autocast on CPU."
                )
                _warned_cpu_fp16 = True
        self._dtype = {True: torch.float16, "bf16": torch.bfloat16}.get(self.mode)
        self._autocast_on = self._dtype is not None and not (self.mode is True and self.device_type == "cpu")
        self.scaler = torch.amp.GradScaler(self.device_type, enabled=self.mode is True and self.device_type == "cuda")
        self.apex_amp = import_apex_amp() if self.mode == "apex" else None

    @property
    def enabled(self):
        """True when anything differs from plain fp32 (autocast, a scaler or apex)."""
        return self._autocast_on or self.apex_amp is not None

    @property
    def autocast_dtype(self):
        """The low-precision dtype used inside :meth:`autocast`, or None."""
        return self._dtype if self._autocast_on else None

    def initialize(self, models, optimizers, apex_args=None):
        """Let apex patch the models and optimizers (before any DDP wrap); a no-op otherwise.

        Takes and returns lists.
        """
        if self.apex_amp is None:
            return models, optimizers
        models, optimizers = self.apex_amp.initialize(models, optimizers, **(apex_args or {}))
        as_list = lambda x: list(x) if isinstance(x, (list, tuple)) else [x]  # noqa: E731
        return as_list(models), as_list(optimizers)

    def autocast(self):
        """Context manager running the forward pass (and loss) in the low-precision dtype."""
        if not self._autocast_on:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self._dtype)

    def backward(self, loss, optimizer=None):
        """``loss.backward()``, scaled by the GradScaler or apex when they are on."""
        if self.apex_amp is not None:
            if optimizer is None:
                raise ValueError("use_fp16='apex' needs the optimizer in backward(loss, optimizer)")
            with self.apex_amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
        else:
            self.scaler.scale(loss).backward()

    def unscale_(self, optimizer):
        """Unscale ``optimizer``'s gradients in place, e.g. before gradient clipping."""
        if self.scaler.is_enabled():
            self.scaler.unscale_(optimizer)

    def step(self, *optimizers, update=True):
        """Step every optimizer (skipped by the scaler on inf/NaN gradients), then update the scale once.

        ``GradScaler.update()`` must run once per iteration, after the last optimizer stepped. With
        several optimizers stepped at different points of one iteration (a GAN), pass
        ``update=False`` to every step but the last, or call :meth:`update_scale` at the end.
        """
        for optimizer in optimizers:
            self.scaler.step(optimizer)
        if update:
            self.scaler.update()

    def update_scale(self):
        """Update the loss scale once for this iteration (after ``step(..., update=False)`` calls)."""
        self.scaler.update()

    def state_dict(self):
        """The checkpoint entries: ``{"amp_native": ...}``, ``{"amp_apex": ...}`` or ``{}``."""
        if self.apex_amp is not None:
            return {"amp_apex": self.apex_amp.state_dict()}
        if self.scaler.is_enabled():
            return {"amp_native": self.scaler.state_dict()}
        return {}

    def load_state_dict(self, state):
        """Restore what :meth:`state_dict` saved (reads the legacy ``amp`` key for apex too)."""
        apex_state = state.get("amp_apex", state.get("amp"))
        if self.apex_amp is not None and apex_state is not None:
            self.apex_amp.load_state_dict(apex_state)
        if self.scaler.is_enabled() and state.get("amp_native") is not None:
            self.scaler.load_state_dict(state["amp_native"])


class LegacyAmp:
    """What 1.x custom loops reach as ``self._amp``: ``autocast()`` and ``scale_loss`` of this precision.

    Example:
        >>> import torch
        >>> with LegacyAmp(Precision(False)).autocast():
        ...     pass
    """

    def __init__(self, precision):
        self._precision = precision

    def autocast(self, *args, **kwargs):
        return self._precision.autocast()

    def __getattr__(self, name):
        if name == "_precision":  # not set yet (a copy or an unpickled one): no recursion
            raise AttributeError(name)
        if self._precision.apex_amp is not None:
            return getattr(self._precision.apex_amp, name)
        raise AttributeError(name)


class PrecisionHelpers:
    """``autocast()``, ``backward()``, ``step()``, ``update_scale()``, ``unscale_gradients()``, ``backward_and_step()``.

    Example:
        >>> # in train_batch: with self.autocast(): loss = ...; self.backward_and_step(loss, self.optimizer)
    """

    _precision: Precision  # provided by the host class (TrainingOperator sets it in __init__)

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
        update to a later step of the iteration. ``clip_grad_norm``: the gradients' largest norm (a number or a
        one-element tensor > 0); None or 0 clip nothing, as Lightning's ``gradient_clip_val``. Example (a GAN's
        train_batch):
            >>> # self.backward_and_step(d_loss, opt_d, update_scale=False); self.backward_and_step(g_loss, opt_g)
        """
        tensor = isinstance(clip_grad_norm, torch.Tensor) and clip_grad_norm.numel() == 1 \
            and clip_grad_norm.is_floating_point()  # its value stays on its device: no host sync per step
        expect(clip_grad_norm is None or tensor or is_number(clip_grad_norm, minimum=0), "clip_grad_norm",
               "a number >= 0 (0 or None: no clipping)", clip_grad_norm, caller="backward_and_step")  # < 0 flips them
        optimizer.zero_grad()
        self.backward(loss, optimizer)
        if clip_grad_norm is not None and (tensor or clip_grad_norm > 0):  # 0 zeroed every gradient
            self.unscale_gradients(optimizer)
            params = [p for group in optimizer.param_groups for p in group["params"]]
            torch.nn.utils.clip_grad_norm_(params, clip_grad_norm)
        self.step(optimizer, update=update_scale)
