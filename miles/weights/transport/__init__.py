"""How pushed weights travel from a trainer to its engines: one definition, imported by both ends.

- ``segments``: the shared-memory files in /dev/shm a push on one node writes its buckets into
  (made and locked by the trainer, read by the engines, swept when their maker is gone);
- ``cuda_ipc``: a flat bucket in the trainer's GPU memory, shared as a CUDA IPC handle and opened
  by an engine on the same node;
- ``documents``: what ``/update_weights_from_tensor`` carries for each miles ``load_format``, a
  typed document encoded by the trainer and decoded, strictly, by the engine;
- ``groups``: the torch.distributed group of a push across nodes: formed by the trainer as rank
  0, joined by each engine as rank N, one broadcast per bucket.
"""
