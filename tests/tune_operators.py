"""Operators for tests/api/test_tune.py (workers import them by name: tests/ is on their PYTHONPATH)."""
import os

import helpers


class LinearOperator(helpers.LinearOperator):
    """The shared linear-regression operator with smaller default data (Tune runs many trainers)."""

    def setup(self, config):
        config.setdefault("data_size", 64)
        config.setdefault("val_size", 32)
        super().setup(config)


class CrashingOperator(LinearOperator):
    """Kills its own worker process at the start of epoch ``crash_epoch`` until ``crashes`` files are in ``crash_dir``.

    Each crash leaves one file in ``crash_dir``, so the count of crashes survives restarts.
    """

    def train_epoch(self, iterator, info=None, num_steps=None, epoch_idx=0):
        crash_dir = self.config.get("crash_dir")
        if crash_dir and (info or {}).get("epoch_idx") == self.config.get("crash_epoch", 1):
            done = len(os.listdir(crash_dir))
            if done < self.config.get("crashes", 1):
                with open(os.path.join(crash_dir, f"crash-{done}"), "w", encoding="utf-8") as handle:
                    handle.write(str(os.getpid()))
                os._exit(1)
        return super().train_epoch(iterator, info)


class StallOnGoOperator(LinearOperator):
    """Once ``config["go"]`` exists, rank 0 writes ``config["stalled"]`` and sleeps (its node is about to be removed).

    The ``stalled`` file makes it happen once: the trial restored afterwards trains normally.
    """

    def train_batch(self, batch, batch_info):
        go, stalled = self.config.get("go"), self.config.get("stalled")
        if go and self.world_rank == 0 and os.path.exists(go) and not os.path.exists(stalled):
            with open(stalled, "w", encoding="utf-8") as handle:
                handle.write(str(os.getpid()))
            import time  # noqa: PLC0415

            time.sleep(120)  # killed with its node long before this ends
        return super().train_batch(batch, batch_info)
