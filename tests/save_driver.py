"""A driver (its own Ray cluster) that saves a sharded trainer to one path twice, and stops inside the second save.

``python save_driver.py PATH STAGE SIGNAL``: 2 FSDP workers train CountingOperator's epoch (every ``p[i]`` becomes 1)
and ``save(PATH)``; they train a second epoch (``p`` becomes 2) and ``save(PATH)`` again, which stops at ``STAGE``
forever after writing SIGNAL, for tests/cluster/state/test_fsdp_state.py to SIGKILL the process (and its cluster) there:

- ``head``: the new state file (``trainer.1.checkpoint``) written, the parts' tasks started (maybe still writing);
- ``metadata``: the new DCP ``.metadata`` written too (DCP's readers see the new set), not yet the marker.
"""
import functools
import os
import sys
import time

import ray

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from helpers import CountingOperator, seeding_hook  # noqa: E402

from raysgd import TorchTrainer  # noqa: E402
from raysgd.torch.storage import dcp_files, filesystem  # noqa: E402


def stop_after(module, name, suffix, signal_path):
    """``module.name`` wrapped: after it writes a path ending in ``suffix``, write ``signal_path`` and wait."""
    original = getattr(module, name)

    @functools.wraps(original)
    def wrapped(fs, path, *args, **kwargs):
        result = original(fs, path, *args, **kwargs)
        if str(path).endswith(suffix):
            with open(signal_path, "w") as handle:
                handle.write(str(os.getpid()))
            time.sleep(3600)
        return result

    setattr(module, name, wrapped)


def main(path, stage, signal_path):
    ray.init(num_cpus=2, include_dashboard=False)
    trainer = TorchTrainer(training_operator_cls=CountingOperator, num_workers=2, strategy="fsdp", timeout_s=60,
                           initialization_hook=seeding_hook, config={"n": 16, "batch_size": 4})
    trainer.train()
    trainer.save(path)
    trainer.train()
    if stage == "head":
        stop_after(filesystem, "write_state_file", filesystem.STATE_FILES[1], signal_path)
    else:
        stop_after(dcp_files, "write_file", dcp_files.METADATA_FILE, signal_path)
    trainer.save(path)
    raise AssertionError("the second save was expected to stop")


if __name__ == "__main__":
    main(*sys.argv[1:4])
