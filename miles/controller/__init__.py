"""The controller: verified weight updates under one lock, routing, and the fleet's one health.

No HTTP and no Ray here: the adapters call in (``miles.http``, ``miles.ray``).
"""
