"""Rollouts: the servers of one model, run by one server type, each server a state machine."""
