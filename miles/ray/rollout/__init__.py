"""InferenceController, the RolloutServer base and its server state machine, router, health."""
