"""``cas_ckpt.dcp``: a cas_ckpt repository as torch.distributed.checkpoint storage (needs torch).

``dcp.save(state_dict, storage_writer=cas_ckpt.dcp.Writer(repo, ref=...))`` and
``dcp.load(state_dict, storage_reader=cas_ckpt.dcp.Reader(repo, target))``; see
``docs/scale-out.md``. The implementation lives with the other framework code in
:mod:`cas_ckpt.integrations.dcp`; ``import cas_ckpt`` alone never imports torch.
"""

from cas_ckpt.integrations.dcp import MixedCheckpoints, Reader, ReplicaMismatch, Writer, load_full

__all__ = ["MixedCheckpoints", "Reader", "ReplicaMismatch", "Writer", "load_full"]
