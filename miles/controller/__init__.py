"""The controller: verified weight updates under one lock, routing, and the fleet's one health.

``core`` (AsyncInferenceController) drives ``transaction`` (one WeightUpdate per update) over the
``fleet`` of rollouts; ``gate`` decides whether a checkpoint may be loaded at all, ``published``
remembers what training published, ``router`` picks a serving server per request, ``health``
aggregates one report, ``events`` writes what happened. No HTTP and no Ray here: the adapters
call in (``miles.http``, ``miles.ray``).
"""
