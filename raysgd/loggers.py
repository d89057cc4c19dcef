"""Loggers: callbacks that send a trainer's results to experiment trackers (``TorchTrainer(callbacks=[...])``).

Package glue: the public home of :class:`~raysgd.torch.integrations.mlflow_logger.MLflowLogger`. Each logger's
package is optional and imported only when a logger is made (``pip install "raysgd[mlflow]"``).

Example:
    >>> from raysgd.loggers import MLflowLogger
    >>> logger = MLflowLogger(tracking_uri="/tmp/mlruns", experiment_name="demo")  # doctest: +SKIP
"""
from raysgd.torch.integrations.mlflow_logger import MLflowLogger

__all__ = ["MLflowLogger"]
