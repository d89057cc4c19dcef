"""Durable storage of checkpoints: a folder, NFS or an object store, and the automatic checkpoints of a run.

Layer 4 (pyarrow, optional and imported on first use): checkpoint directories with a completion marker on any
filesystem ``pyarrow.fs`` opens (:mod:`~raysgd.torch.storage.filesystem`), ``TorchTrainer(storage_path=...)``'s
checkpoints and resume (:mod:`~raysgd.torch.storage.durable`), and the background thread that uploads them
(:mod:`~raysgd.torch.storage.async_writer`); sharded (DCP) checkpoint folders written by every rank and loaded at any
world size (:mod:`~raysgd.torch.storage.dcp_files`).

Example:
    >>> from raysgd.torch.storage.durable import open_run
    >>> open_run(None).resume(None) is None  # no storage_path: nothing to do
    True
"""
