"""How pushed weights travel from a trainer to its engines: one definition, imported by both ends
(the shared-memory ``segments``, ``cuda_ipc`` handles, the ``documents`` a push names them in, the
torch.distributed ``groups`` of a push across nodes)."""
