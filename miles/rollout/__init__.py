"""Rollouts: the servers of one model, launched, probed, restarted and stopped by one server type
(``Rollout``; ``SFTRollout`` runs embedded engines, ``SGLangRollout`` SGLang servers, launched or
attached), each server's state machine (``state``), and
the one client every server type is spoken to with (``engine_client``)."""
