"""What miles runs inside vLLM's worker processes (docs/VLLM.md); imported by vLLM's workers, never by miles."""
