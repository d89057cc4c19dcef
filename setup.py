"""raysgd: the RaySGD 1.x PyTorch API rebuilt on Ray 2.x and PyTorch 2.x.

The version has one home, ``raysgd/__init__.py``'s ``__version__``, read here without importing raysgd. The PyPI
page is README.md with its relative links and images made absolute (they point into the repository on GitHub),
so the same file reads right on GitHub, in a checkout and on PyPI.
"""
import os
import re

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
REPOSITORY = "https://github.com/raysgd/raysgd"
BRANCH = "main"


def read(*parts):
    with open(os.path.join(HERE, *parts), encoding="utf-8") as handle:
        return handle.read()


def version():
    """``__version__`` of raysgd/__init__.py (the one place it is written)."""
    found = re.search(r'^__version__ = "([^"]+)"$', read("raysgd", "__init__.py"), flags=re.M)
    if found is None:
        raise RuntimeError("raysgd/__init__.py has no line __version__ = \"...\"")
    return found.group(1)


def absolute_links(markdown, repository=REPOSITORY, branch=BRANCH):
    """``markdown`` with every relative link and image target made an absolute URL into ``repository``.

    Images point at the raw file, links at GitHub's page for it; absolute URLs and in-page anchors stay.

    Example:
        >>> absolute_links("[docs](docs/fsdp.md#state) ![arch](docs/images/a.png) [x](https://x.org) [y](#y)")
        '[docs](https://github.com/raysgd/raysgd/blob/main/docs/fsdp.md#state) ![arch](https://raw.githubusercontent.com/raysgd/raysgd/main/docs/images/a.png) [x](https://x.org) [y](#y)'
    """
    raw = repository.replace("https://github.com/", "https://raw.githubusercontent.com/")

    def rewrite(match):
        bang, text, target = match.groups()
        if re.match(r"^([a-z][a-z0-9+.-]*:|#)", target):
            return match.group(0)
        path = target.lstrip("./")
        if bang:
            url = f"{raw}/{branch}/{path}"
        else:
            url = f"{repository}/{'tree' if path.split('#')[0].endswith('/') else 'blob'}/{branch}/{path}"
        return f"{bang}[{text}]({url})"

    return re.sub(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)", rewrite, markdown)


if __name__ == "__main__":
    setup(
        name="raysgd",
        version=version(),
        description="The RaySGD PyTorch API (TorchTrainer, TrainingOperator) on Ray 2.x and PyTorch 2.x: "
                    "fault-tolerant, exactly-once distributed training driven from a Python script",
        long_description=absolute_links(read("README.md")),
        long_description_content_type="text/markdown",
        url=REPOSITORY,
        project_urls={
            "Documentation": f"{REPOSITORY}/tree/{BRANCH}/docs",
            "Source": REPOSITORY,
            "Changelog": f"{REPOSITORY}/blob/{BRANCH}/CHANGELOG.md",
            "Issues": f"{REPOSITORY}/issues",
        },
        license="Apache-2.0",
        license_files=["LICENSE", "NOTICE"],
        keywords=["pytorch", "ray", "distributed training", "fault tolerance", "raysgd", "ddp", "fsdp"],
        classifiers=[
            "Development Status :: 4 - Beta",
            "Intended Audience :: Developers",
            "Intended Audience :: Science/Research",
            "Operating System :: POSIX :: Linux",
            "Programming Language :: Python :: 3",
            "Programming Language :: Python :: 3 :: Only",
            "Programming Language :: Python :: 3.10",
            "Programming Language :: Python :: 3.11",
            "Programming Language :: Python :: 3.12",
            "Programming Language :: Python :: 3.13",
            "Programming Language :: Python :: 3.14",
            "Topic :: Scientific/Engineering :: Artificial Intelligence",
            "Topic :: System :: Distributed Computing",
        ],
        packages=find_packages(include=["raysgd", "raysgd.*"]),
        # the pins of constraints.txt (torch 2.13, ray 2.58) have wheels for CPython 3.10 to 3.14, none for 3.9
        python_requires=">=3.10",
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
            "metrics": ["ray[default]>=2.9"],  # the node's metrics agent, which exports ray.util.metrics to Prometheus
            "export": ["safetensors"],  # raysgd export: a checkpoint's weights as a safetensors file
            # what every script in examples/ needs beyond the plain install (README's examples table names each)
            "examples": ["scikit-learn", "matplotlib", "ray[tune]>=2.9", "pytorch-lightning>=2"],
            # the documentation site: mkdocs build --strict (.ci/run), API reference from the docstrings
            "docs": ["mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26"],
            "test": ["pytest>=7", "pytest-timeout", "pytest-xdist>=3.6",  # README's test command runs two lanes
                     "scikit-learn", "tqdm", "ray[tune]>=2.9", "tensorboardX",
                     "matplotlib", "pandas", "pyarrow", "moto[server]", "py-spy",
                     "pytorch-lightning>=2", "lightning>=2", "mlflow", "wandb", "safetensors",  # both of Lightning's import names are tested
                     "ray[default]>=2.9",  # the metrics agent: tests/cluster/integrations/test_ray_metrics.py reads its export (CHANGELOG: cost)
                     "mypy>=1.10"],  # .ci/run type-checks raysgd/ (pyproject.toml's [tool.mypy])
        },
        entry_points={"console_scripts": ["raysgd = raysgd.cli:main"]},  # raysgd run | checkpoints | export
    )
