"""Hyperparameter tuning of a TorchTrainer with Ray Tune's ``tune.Tuner`` (Ray 2.x).

A grid search over the learning rate: every trial is a TorchTrainer with ``--num-workers`` workers,
trained for 2 iterations (one ``train()`` and one ``validate()`` each), checkpointed every
iteration; the best config is chosen by ``val_loss``. ``--manual`` steps a ``ReduceLROnPlateau``
scheduler by hand on ``val_loss`` in a custom step (``override_tune_step``).

Run it:
    python examples/tune_example.py --smoke-test
    python examples/tune_example.py --smoke-test --manual --num-workers 2
"""
import argparse
import logging
import tempfile

import ray

from raysgd import optional
from raysgd.torch import TorchTrainer
from raysgd.torch.examples.tune_example import get_custom_training_operator, manual_step
from raysgd.utils import BATCH_SIZE

logger = logging.getLogger("tune_example")
# Ray Tune is optional for raysgd; without it this says what to install: pip install "raysgd[examples]"
tune = optional.require("ray.tune", "examples/tune_example.py", extra="examples")


def tune_lr(num_workers=1, use_gpu=False, manual=False, num_samples=1, storage_path=None, max_failures=1):
    """Run the grid search; returns Tune's ``ResultGrid``."""
    TorchTrainable = TorchTrainer.as_trainable(  # noqa: N806 (a class)
        training_operator_cls=get_custom_training_operator(lr_reduce_on_plateau=manual),
        num_workers=num_workers, use_gpu=use_gpu, config={BATCH_SIZE: 128},
        scheduler_step_freq="manual" if manual else None,
        override_tune_step=manual_step if manual else None)
    tuner = tune.Tuner(
        TorchTrainable,
        param_space={"lr": tune.grid_search([1e-4, 1e-3])},
        tune_config=tune.TuneConfig(metric="val_loss", mode="min", num_samples=num_samples),
        run_config=tune.RunConfig(
            stop={"training_iteration": 2},
            storage_path=storage_path,
            checkpoint_config=tune.CheckpointConfig(checkpoint_frequency=1, num_to_keep=1),
            failure_config=tune.FailureConfig(max_failures=max_failures),
            verbose=1))
    return tuner.fit()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default=None, help="Ray cluster address (default: start one)")
    parser.add_argument("--num-workers", "-n", type=int, default=1)
    parser.add_argument("--use-gpu", action="store_true", default=False)
    parser.add_argument("--manual", action="store_true", help="step ReduceLROnPlateau by hand on val_loss")
    parser.add_argument("--smoke-test", action="store_true", help="one sample per grid point, results in a temp dir")
    parser.add_argument("--storage-path", default=None, help="where Tune writes results (default ~/ray_results)")
    args = parser.parse_args(argv)
    if not ray.is_initialized():
        ray.init(address=args.address or "local", num_cpus=4 if args.smoke_test and not args.address else None,
                 include_dashboard=False)
    storage_path = args.storage_path or (tempfile.mkdtemp(prefix="raysgd-tune-") if args.smoke_test else None)
    results = tune_lr(num_workers=args.num_workers, use_gpu=args.use_gpu, manual=args.manual,
                      num_samples=1 if args.smoke_test else 3, storage_path=storage_path)
    if results.errors:
        raise RuntimeError(f"{len(results.errors)} trial(s) failed; the first error is the cause") \
            from results.errors[0]
    best = results.get_best_result()
    print(f"Best config: {best.config}; val_loss {best.metrics['val_loss']:.4f}; "
          f"checkpoint {best.checkpoint.path if best.checkpoint else None}")
    return results


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    main()
