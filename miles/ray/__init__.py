"""The controller side of miles: the InferenceController, its rollout servers, router and health.

Ray is used only in the adapter modules here (actors and placement); the logic runs without it.
"""
