"""Loggers: callbacks that send a trainer's results to experiment trackers (``TorchTrainer(callbacks=[...])``).

Package glue: the public home of :class:`~raysgd.torch.integrations.mlflow_logger.MLflowLogger` and
:class:`~raysgd.torch.integrations.wandb_logger.WandbLogger`. Each logger's
package is optional and imported only when a logger is made (``pip install "raysgd[mlflow]"``,
``pip install "raysgd[wandb]"``).

Example:
    >>> from raysgd.loggers import MLflowLogger
    >>> logger = MLflowLogger(tracking_uri="/tmp/mlruns", experiment_name="demo")  # doctest: +SKIP
    >>> from raysgd.loggers import WandbLogger
    >>> logger = WandbLogger(project="demo", mode="offline", dir="/tmp/wandb")  # doctest: +SKIP
"""
from raysgd.torch.integrations.mlflow_logger import MLflowLogger
from raysgd.torch.integrations.wandb_logger import WandbLogger

__all__ = ["MLflowLogger", "WandbLogger"]
