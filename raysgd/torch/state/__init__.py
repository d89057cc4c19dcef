"""The training state: one format, its files, and the commits that make restart points inside an epoch.

Layer 2 (torch, numpy; Ray only for the commits' actors): the state of one worker's operator built and
restored in one place (:mod:`~raysgd.torch.state.training_state`), checkpoint files written atomically and
loaded safely (:mod:`~raysgd.torch.state.checkpoint`), CPU copies of models (:mod:`~raysgd.torch.state.model_copy`),
and commits: taken by each worker (:mod:`~raysgd.torch.state.committer`), kept with the workers (their small
records in :mod:`~raysgd.torch.state.commit_store`, their state parts by :mod:`~raysgd.torch.state.part_holders`)
and planned and resumed by the driver (:mod:`~raysgd.torch.state.commit_policy`); the sharded state of FSDP2 models
in DCP's format, one blob per rank, loaded at any world size, each rank reading only its rows
(:mod:`~raysgd.torch.state.sharded`; its bytes written by :mod:`~raysgd.torch.state.dcp_blobs` and read by
:mod:`~raysgd.torch.state.dcp_reader`).

Example:
    >>> from raysgd.torch.state.checkpoint import state_from_bytes, state_to_bytes
    >>> state_from_bytes(state_to_bytes({"epoch": 1}))
    {'epoch': 1}
"""
