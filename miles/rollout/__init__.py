"""Rollout server implementations: the fleets of inference engines the controller drives."""
