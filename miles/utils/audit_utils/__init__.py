"""Audit trail of miles: typed events, the JSONL log that records them, and offline checks over it."""
