"""raysgd: the RaySGD 1.x PyTorch API rebuilt on Ray 2.x and PyTorch 2.x."""
import os

from setuptools import find_packages, setup

here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "README.md"), encoding="utf-8") as handle:
    long_description = handle.read()

setup(
    name="raysgd",
    version="0.1.0",
    description="The RaySGD PyTorch API (TorchTrainer, TrainingOperator) on Ray 2.x and PyTorch 2.x",
    long_description=long_description,
    long_description_content_type="text/markdown",
    packages=find_packages(include=["raysgd", "raysgd.*"]),
    python_requires=">=3.9",
    install_requires=["ray>=2.9", "torch>=2.3", "numpy", "filelock", "tabulate"],
    extras_require={
        "tune": ["ray[tune]>=2.9"],
        "tqdm": ["tqdm"],
        "logging": ["tensorboardX", "matplotlib"],
        "data": ["ray[data]>=2.9"],
        "lightning": ["pytorch-lightning>=2"],
        "storage": ["pyarrow>=9"],
        "diagnostics": ["py-spy"],  # stacks of a rank that cannot answer (trainer.stack_traces, stuck-rank errors)
        "mlflow": ["mlflow"],  # raysgd.loggers.MLflowLogger
        "wandb": ["wandb"],  # raysgd.loggers.WandbLogger
        "export": ["safetensors"],  # raysgd export: a checkpoint's weights as a safetensors file
        "metrics": ["ray[default]>=2.9"],  # the node's metrics agent, which exports ray.util.metrics to Prometheus
        # what every script in examples/ needs beyond the plain install (README's examples table names each)
        "examples": ["scikit-learn", "matplotlib", "ray[tune]>=2.9", "pytorch-lightning>=2"],
        "test": ["pytest>=7", "pytest-timeout", "scikit-learn", "tqdm", "ray[tune]>=2.9", "tensorboardX",
                 "matplotlib", "pandas", "pyarrow", "moto[server]", "py-spy",
                 "pytorch-lightning>=2", "lightning>=2", "mlflow", "wandb", "safetensors",  # both of Lightning's import names are tested
                 "ray[default]>=2.9"],  # the metrics agent: tests/test_ray_metrics.py reads its export (CHANGELOG: cost)
    },
    entry_points={"console_scripts": ["raysgd = raysgd.cli:main"]},  # raysgd run | checkpoints | export
    license="Apache-2.0",
)
