"""Rollouts: the servers of one model, run by one server type (``Rollout``), each server's state
machine (``state``), and the one client every server type is spoken to with (``engine_client``)."""
