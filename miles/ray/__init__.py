"""Ray adapters (every Ray API call of miles lives under this package), and the seed's import paths."""
