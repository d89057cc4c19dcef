"""The 1.x DCGAN example on the 8x8 digits images: two models, two optimizers and a custom ``train_batch``.

RaySGD 1.12 trained on MNIST and scored the generator with a downloaded LeNet; here the data is
scikit-learn's ``load_digits`` (no download) and the scoring classifier is trained on it first
(:func:`train_classifier`, a few seconds). ``train_batch`` uses the operator's mixed-precision
helpers, ``self.autocast()`` and ``self.backward_and_step(loss, optimizer)``, so ``use_fp16``
works unchanged (``"bf16"`` on CPU, ``True`` on CUDA). The discriminator's step passes
``update_scale=False``, so the GradScaler's scale is updated once per iteration, after the
generator's step (1.12 updated it twice). The discriminator returns logits and the
loss is ``BCEWithLogitsLoss`` (1.12 used ``BCELoss`` after a sigmoid, which autocast refuses).

Run it: ``python -m raysgd.torch.examples.dcgan --num-workers 2`` (or ``--smoke-test``).

Example:
    >>> from raysgd.torch.examples.dcgan import GANOperator, train_example  # doctest: +SKIP
    >>> trainer = train_example(num_workers=2, test_mode=True)  # doctest: +SKIP
"""
import argparse
import logging
import os
import tempfile

import numpy as np
import torch
import torch.nn as nn
from filelock import FileLock
from torch.utils.data import DataLoader, TensorDataset

from raysgd import optional
from raysgd.torch import TorchTrainer, TrainingOperator
from raysgd.torch.examples.train_example import loader_batch_size
from raysgd.utils import BATCH_SIZE, NUM_SAMPLES

logger = logging.getLogger(__name__)


def digits_images(limit=None, seed=0):
    """``(images, labels)``: the 1797 digits as float tensors of shape (N, 1, 8, 8) scaled to [-1, 1].

    Example:
        >>> images, labels = digits_images(limit=4)
        >>> tuple(images.shape), float(images.min()) >= -1.0
        ((4, 1, 8, 8), True)
    """
    datasets = optional.require("sklearn.datasets", "the DCGAN example's data (scikit-learn's digits)")
    images, labels = datasets.load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(labels))[:limit]
    images = torch.tensor(images[order] / 8.0 - 1.0, dtype=torch.float32).view(-1, 1, 8, 8)
    return images, torch.tensor(labels[order], dtype=torch.long)


class Generator(nn.Module):
    """Latent vector -> 2x2 -> 4x4 -> 8x8 image in [-1, 1] (transposed convolutions).

    Example:
        >>> Generator(latent_dim=16)(torch.randn(2, 16)).shape
        torch.Size([2, 1, 8, 8])
    """

    def __init__(self, latent_dim=16, width=64):
        super().__init__()
        self.width = width
        self.project = nn.Sequential(nn.Linear(latent_dim, width * 2 * 2 * 2), nn.BatchNorm1d(width * 8), nn.ReLU())
        self.upsample = nn.Sequential(
            nn.ConvTranspose2d(width * 2, width, 4, stride=2, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.ConvTranspose2d(width, 1, 4, stride=2, padding=1), nn.Tanh())

    def forward(self, z):
        return self.upsample(self.project(z).view(-1, self.width * 2, 2, 2))


class Discriminator(nn.Module):
    """8x8 image -> 4x4 -> 2x2 -> one logit (real or fake). No batch norm: real and fake are scored apart.

    Example:
        >>> Discriminator()(torch.zeros(3, 1, 8, 8)).shape
        torch.Size([3, 1])
    """

    def __init__(self, width=64):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, width, 4, stride=2, padding=1), nn.LeakyReLU(0.2),
            nn.Conv2d(width, width * 2, 4, stride=2, padding=1), nn.LeakyReLU(0.2),
            nn.Flatten(), nn.Linear(width * 2 * 2 * 2, 1))

    def forward(self, x):
        return self.net(x)


def _classifier():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def train_classifier(path, epochs=60, seed=0):
    """Train the digits classifier that scores generated images and save its state dict to ``path``.

    Runs once per path: the file is written under a lock, and an existing file is kept.

    Example:
        >>> train_classifier("/tmp/digits_classifier.pt")  # doctest: +SKIP
    """
    with FileLock(path + ".lock", timeout=600):  # another process may be training it: wait, but not forever
        if os.path.exists(path):
            return path
        torch.manual_seed(seed)
        images, labels = digits_images()
        model = _classifier()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        for _ in range(epochs):  # full-batch: 1797 images of 64 pixels
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
        accuracy = (model(images).argmax(1) == labels).float().mean().item()
        logger.info("scoring classifier: training accuracy %.3f", accuracy)
        tmp = f"{path}.{os.getpid()}.tmp"
        torch.save(model.state_dict(), tmp)
        os.replace(tmp, path)
    return path


def inception_score(classifier, images, eps=1e-12):
    """``exp(E_x KL(p(y|x) || p(y)))`` under ``classifier``: 1 for one blurry class, up to 10 for varied crisp digits.

    Example:
        >>> round(inception_score(torch.nn.Identity(), torch.eye(10) * 50), 3)
        10.0
    """
    with torch.no_grad():
        probs = torch.softmax(classifier(images.float()), dim=1)
        marginal = probs.mean(dim=0, keepdim=True)
        kl = (probs * (torch.log(probs + eps) - torch.log(marginal + eps))).sum(dim=1)
    return float(torch.exp(kl.mean()))


class GANOperator(TrainingOperator):
    """Registers a discriminator and a generator with one Adam optimizer each; ``train_batch`` alternates them.

    Config keys: ``classification_model_path`` (from :func:`train_classifier`), ``"batch_size"`` (1.12's key)
    or else ``BATCH_SIZE`` (the global batch, split among the workers), 32 without either
    (:func:`~raysgd.torch.examples.train_example.loader_batch_size`), ``lr`` (2e-3), ``latent_dim`` (16; 1.12's
    ``latent_vector_size`` too), ``limit`` (use the first N images; 1.12's ``test_mode`` uses 64).

    Example:
        >>> trainer = TorchTrainer(training_operator_cls=GANOperator, num_workers=2,  # doctest: +SKIP
        ...                        config={BATCH_SIZE: 64, "classification_model_path": train_classifier(path)})
    """

    def setup(self, config):
        torch.manual_seed(config.get("seed", 0))
        latent_dim = config.get("latent_dim", config.get("latent_vector_size", 16))  # the second: 1.12's key
        discriminator, generator = Discriminator(), Generator(latent_dim)
        betas = (0.5, 0.999)
        optimizer_d = torch.optim.Adam(discriminator.parameters(), lr=config.get("lr", 2e-3), betas=betas)
        optimizer_g = torch.optim.Adam(generator.parameters(), lr=config.get("lr", 2e-3), betas=betas)
        self.models, self.optimizers, self.criterion = self.register(
            models=(discriminator, generator), optimizers=(optimizer_d, optimizer_g), criterion=nn.BCEWithLogitsLoss())
        images, _ = digits_images(limit=config.get("limit", 64 if config.get("test_mode") else None))
        self.register_data(train_loader=DataLoader(TensorDataset(images), batch_size=loader_batch_size(config),
                                                   shuffle=True, drop_last=True))
        self.classifier = _classifier().to(self.device).eval()
        state = torch.load(config["classification_model_path"], map_location=self.device, weights_only=True)
        self.classifier.load_state_dict(state)
        self.latent_dim = latent_dim

    def train_batch(self, batch, batch_info):
        """One discriminator step, then one generator step; returns both losses and the inception score."""
        discriminator, generator = self.models
        optimizer_d, optimizer_g = self.optimizers
        real = batch[0].to(self.device)
        n = real.size(0)
        ones = torch.ones(n, 1, device=self.device)
        zeros = torch.zeros(n, 1, device=self.device)
        noise = torch.randn(n, self.latent_dim, device=self.device)

        # Discriminator: score real images as 1 and generated ones as 0 (one forward pass for both).
        with self.autocast():
            fake = generator(noise)
            logits = discriminator(torch.cat([real, fake.detach()]))
            loss_d = self.criterion(logits.float(), torch.cat([ones, zeros]))
        # Under fp16 the GradScaler's scale is updated once per iteration, after the last step: not here.
        self.backward_and_step(loss_d, optimizer_d, update_scale=False)

        # Generator: make the (just updated) discriminator score the generated images as 1.
        with self.autocast():
            loss_g = self.criterion(discriminator(fake).float(), ones)
        self.backward_and_step(loss_g, optimizer_g)  # steps the generator, then updates the scale once

        return {"loss_g": loss_g.item(), "loss_d": loss_d.item(),
                "inception": inception_score(self.classifier, fake.detach()), NUM_SAMPLES: n}

    def sample(self, n=16, seed=0):
        """``n`` generated images (CPU tensor, values in [-1, 1]) from a fixed noise ``seed``.

    Example:
        >>> images = trainer.apply_all_operators(lambda op: op.sample(16))[0]  # doctest: +SKIP
    """
        generator = self.registered_models()[1]  # unwrapped: no DDP collectives for a local sample
        noise = torch.randn(n, self.latent_dim, generator=torch.Generator().manual_seed(seed)).to(self.device)
        generator.eval()
        with torch.no_grad():
            images = generator(noise).float().cpu()
        generator.train()
        return images


def train_example(num_workers=1, use_gpu=False, test_mode=False, data_dir=None, num_epochs=None, use_fp16=False,
                  use_tqdm=False):
    """Train the GAN for ``num_epochs`` (default 1 in ``test_mode``, else 30); returns the trainer (still running).

    ``data_dir`` holds the scoring classifier (default: the temp directory).

    Example:
        >>> trainer = train_example(num_workers=2, test_mode=True)  # doctest: +SKIP
        >>> trainer.shutdown()  # doctest: +SKIP
    """
    data_dir = data_dir or tempfile.gettempdir()
    os.makedirs(data_dir, exist_ok=True)
    classifier_path = train_classifier(os.path.join(data_dir, "raysgd_digits_classifier.pt"))
    num_epochs = num_epochs or (1 if test_mode else 30)
    trainer = TorchTrainer(
        training_operator_cls=GANOperator, num_workers=num_workers, use_gpu=use_gpu, use_fp16=use_fp16,
        use_tqdm=use_tqdm,
        config={"lr": 2e-3, BATCH_SIZE: 64, "latent_dim": 16, "classification_model_path": classifier_path,
                "limit": 512 if test_mode else None})
    for epoch in range(num_epochs):
        stats = trainer.train(info={"epoch_idx": epoch, "num_epochs": num_epochs})
        logger.info("epoch %d/%d: loss_d %.3f loss_g %.3f inception %.2f", epoch + 1, num_epochs, stats["loss_d"],
                    stats["loss_g"], stats["inception"])
    return trainer


def main(argv=None):
    """The command line: ``--smoke-test``, ``--num-workers``, ``--num-epochs``, ``--use-gpu``, ``--fp16``, ``--samples``.

    Example:
        >>> main(["--smoke-test"])  # doctest: +SKIP
    """
    parser = argparse.ArgumentParser(description="RaySGD DCGAN on the 8x8 digits")
    parser.add_argument("--smoke-test", action="store_true", help="one epoch on 512 images")
    parser.add_argument("--address", default=None, help="Ray cluster address (default: start a local one)")
    parser.add_argument("--num-workers", "-n", type=int, default=2)
    parser.add_argument("--num-epochs", type=int, default=None, help="default 30 (1 with --smoke-test)")
    parser.add_argument("--use-gpu", action="store_true")
    parser.add_argument("--fp16", default=False, const=True, nargs="?",
                        help="mixed precision: --fp16 (float16 on CUDA) or --fp16 bf16")
    parser.add_argument("--use-tqdm", action="store_true", help="show a progress bar")
    parser.add_argument("--data-dir", default=None, help="where the scoring classifier is kept")
    parser.add_argument("--samples", metavar="PNG", default=None, help="write 16 generated digits to this PNG")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    digits_images(limit=1)  # without scikit-learn, say what to install before Ray starts
    if args.samples:
        optional.require("matplotlib.figure", "dcgan --samples")
    import ray  # noqa: PLC0415

    ray.init(address=args.address or "local", include_dashboard=False)
    trainer = train_example(num_workers=args.num_workers, use_gpu=args.use_gpu, test_mode=args.smoke_test,
                            data_dir=args.data_dir, num_epochs=args.num_epochs, use_fp16=args.fp16,
                            use_tqdm=args.use_tqdm)
    if args.samples:
        images = trainer.apply_all_operators(lambda op: op.sample(16))[0]
        _save_grid(images, args.samples)
        logger.info("generated digits written to %s", args.samples)
    trainer.shutdown()
    ray.shutdown()


def _save_grid(images, path):
    backend = optional.require("matplotlib.backends.backend_agg", "dcgan --samples")
    figure = optional.require("matplotlib.figure", "dcgan --samples").Figure(figsize=(4, 4), dpi=100)
    backend.FigureCanvasAgg(figure)
    for i, image in enumerate(images[:16]):
        axes = figure.add_subplot(4, 4, i + 1)
        axes.imshow(image[0].numpy(), cmap="gray_r", vmin=-1, vmax=1)
        axes.axis("off")
    figure.savefig(path, format="png")


if __name__ == "__main__":
    main()
