"""``free_port`` never hands one interpreter the same port twice while it is kept: launches side by
side (a vLLM server binds its port tens of seconds after it was chosen) must not share one."""

from __future__ import annotations

from miles.rollout.engine_process import free_port


def test_ports_handed_out_in_a_row_are_all_different() -> None:
    # The kernel picks bind(0) ports at random from about 14k: 2000 draws repeat one almost surely.
    ports = [free_port() for _ in range(2000)]
    assert len(set(ports)) == len(ports)
