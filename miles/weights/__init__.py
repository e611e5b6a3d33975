"""Weights: canonical checksums (``checksum``) and verified, atomically written checkpoints (``checkpoint``)."""
