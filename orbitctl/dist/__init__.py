"""Distributed plumbing: the one module that calls torch.distributed's collectives (:mod:`.collectives`), and the
CUDA rehearsal that runs the GPU paths on a CPU with fake ``cuda`` tensors under an 8-rank fake group
(:mod:`.rehearsal`)."""
