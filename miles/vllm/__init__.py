"""What miles runs inside vLLM's processes: the worker extension (``extension``) and the
read-back of what a worker holds (``held``). Imported by vLLM's workers, never by miles itself."""
