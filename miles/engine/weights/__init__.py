"""The served weights and every change to them, one module per step a change passes through:
``sources`` (the bytes: a verified checkpoint, or pushed buckets) → ``stage`` and ``buffers``
(what they are written into: the live tensors, or twins beside them) → ``swap`` (stage, verify,
swap, for loads and pushes alike) → ``live`` (the record of what the weights are). ``memory``
maps where the weights lie, ``lock`` is the weights' reader-writer lock, ``export`` reads them
whole."""
