"""The served weights and every change to them: ``sources`` (the bytes) → ``stage``/``buffers``
(what they are written into) → ``swap`` (stage, verify, swap) → ``live`` (what the weights are,
read whole by a checksum or an export); ``memory`` maps where they lie, ``lock`` guards them."""
