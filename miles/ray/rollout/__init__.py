"""The seed's import paths, kept as thin re-exports."""
