"""miles: keep serving a model while you train it, with verified weight updates."""

__version__ = "0.1.0"
