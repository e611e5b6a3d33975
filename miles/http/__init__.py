"""HTTP adapters of the controller (docs/ARCHITECTURE.md, "The tree"); the logic lives in ``miles.controller``."""
