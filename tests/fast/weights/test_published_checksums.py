"""The store of published checksums: what the gate reads, and its bounds against a flood of posts."""

from __future__ import annotations

import itertools

from miles.controller.published import PublishedChecksum, PublishedChecksums
from miles.utils.audit_utils.event_logger.models import ChecksumRole, InferenceEngineWeightChecksumEvent

_ids = itertools.count()


def published(
    model: str, step: int, checksum: str, role: ChecksumRole = ChecksumRole.PUBLISHED
) -> InferenceEngineWeightChecksumEvent:
    server = None if role is ChecksumRole.PUBLISHED else "m-0"
    return InferenceEngineWeightChecksumEvent(
        event_id=f"e{next(_ids)}", model_name=model, step=step, checksum=checksum, role=role, server_id=server
    )


def test_the_latest_post_of_a_step_wins_and_lookups_read_it() -> None:
    store = PublishedChecksums()
    for event in (published("m", 1, "a"), published("m", 3, "b"), published("m", 1, "c"), published("n", 9, "a")):
        store.observe(event)
    store.observe(published("m", 7, "x", role=ChecksumRole.CONFIRMED))
    assert kept(store.expected("m", 1)).checksum == "c"
    assert store.expected("m", 7) is None, "only the published role is training's word"
    assert kept(store.latest("m")).step == 3
    assert kept(store.matching("m", "b")).step == 3
    assert store.matching("m", "a") is None, "step 1 of m was published again with another checksum"
    assert kept(store.matching("n", "a")).step == 9
    assert store.latest("nobody") is None and store.expected("nobody", 1) is None


def test_each_model_keeps_its_latest_steps_and_a_bounded_number_of_models() -> None:
    store = PublishedChecksums(max_steps_per_model=3, max_models=2)
    for step in (5, 1, 9, 7):
        store.observe(published("m", step, f"c{step}"))
    # Step 1, the oldest, is forgotten, whatever order the steps came in.
    assert [store.expected("m", s) is not None for s in (1, 5, 7, 9)] == [False, True, True, True]
    store.observe(published("n", 1, "n1"))
    store.observe(published("m", 10, "c10"))  # m is now the model published to last
    store.observe(published("o", 1, "o1"))  # a third model: n, published to least recently, goes
    assert store.latest("n") is None
    assert kept(store.latest("m")).step == 10
    assert kept(store.latest("o")).step == 1


def test_a_flood_of_posts_stays_within_the_bounds() -> None:
    store = PublishedChecksums(max_steps_per_model=64, max_models=8)
    for step in range(20_000):
        store.observe(published("m", step, f"{step:032x}"))
    assert [s for s in range(20_000) if store.expected("m", s)] == list(range(20_000 - 64, 20_000))
    # Fifty models in turn, eight kept: each is forgotten before its turn comes again.
    for i in range(20_000):
        store.observe(published(f"model-{i % 50}", i, f"{i:032x}"))
    survivors = {(f"model-{i % 50}", i) for i in range(20_000) if store.expected(f"model-{i % 50}", i)}
    assert survivors == {(f"model-{i % 50}", i) for i in range(20_000 - 8, 20_000)}
    assert store.latest("m") is None


def kept(record: PublishedChecksum | None) -> PublishedChecksum:
    assert record is not None, "expected a published checksum"
    return record
