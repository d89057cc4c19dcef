"""The training state's format: one state, its bytes and files, model copies, and sharded state in DCP's format.

Layer 2 (torch, numpy; no Ray): the state of one worker's operator built and restored in one place
(:mod:`~raysgd.torch.state.training_state`), its bytes serialised once and checkpoint files written atomically and
loaded safely (:mod:`~raysgd.torch.state.checkpoint`), CPU copies of models (:mod:`~raysgd.torch.state.model_copy`);
the sharded state of FSDP2 models in DCP's format, one blob per rank, loaded at any world size, each rank reading
only its rows (:mod:`~raysgd.torch.state.sharded`; its bytes written by :mod:`~raysgd.torch.state.dcp_blobs` and
read by :mod:`~raysgd.torch.state.dcp_reader`). Where the state is kept between calls is
:mod:`raysgd.torch.restart_points`' business, commits inside a call :mod:`raysgd.torch.commits`'.

Example:
    >>> from raysgd.torch.state.checkpoint import state_from_bytes, state_to_bytes
    >>> state_from_bytes(state_to_bytes({"epoch": 1}))
    {'epoch': 1}
"""
