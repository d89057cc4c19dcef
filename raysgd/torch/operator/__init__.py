"""One rank's training helpers, each a mixin or a function of :class:`~raysgd.torch.training_operator.TrainingOperator`.

Layer 1 (torch; nothing here imports the operator, the worker or Ray): mixed precision as one object and the
operator's helpers for it (:mod:`~raysgd.torch.operator.precision`), micro-batches per optimizer step
(:mod:`~raysgd.torch.operator.accumulation`), ``torch.compile``'d models (:mod:`~raysgd.torch.operator.compiled`),
validation without collectives per batch (:mod:`~raysgd.torch.operator.evaluation`), the checks of ``register()``'s
arguments (:mod:`~raysgd.torch.operator.registration`), and the loops of operators built from 1.x creator
functions (:mod:`~raysgd.torch.operator.creators`) or from a LightningModule (:mod:`~raysgd.torch.operator.lightning`,
talking to Lightning through :mod:`~raysgd.torch.operator.lightning_bridge`). The operator classes mix them in;
the factories ``from_creators``/``from_ptl`` build a class from the base class they are given.

Example:
    >>> import torch
    >>> from raysgd.torch.operator.precision import Precision
    >>> Precision(False, torch.device("cpu")).enabled
    False
"""
