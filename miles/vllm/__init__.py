"""What miles runs inside vLLM's processes: the worker extension (``extension``), the read-back of
what a worker holds (``held``) and miles' backend of vLLM's weight transfer (``transfer``).
Imported by vLLM's workers, never by miles itself."""
