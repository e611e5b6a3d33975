"""PushPublisher and ShardedPublisher refuse settings the controller or the engines would refuse
in the middle of a push, when they are built (the pushes themselves are tested in
tests/train/test_push.py and tests/train/test_sharded_publish.py)."""

from __future__ import annotations

import math

import pytest

from miles.errors import PublishError
from miles.train.push import PushPublisher
from miles.train.sharded import ShardedPublisher


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({"timeout_s": 0}, "timeout_s must be a number of seconds between 0.1"),
        ({"timeout_s": -1.0}, "timeout_s must be a number of seconds between 0.1"),
        ({"timeout_s": 7200}, "timeout_s must be a number of seconds between 0.1 and 3600"),
        ({"timeout_s": math.nan}, "timeout_s must be a number of seconds"),
        ({"timeout_s": "60"}, "timeout_s must be a number of seconds"),
        ({"ttl_s": math.inf}, "ttl_s must be a number of seconds"),
        ({"ttl_s": 0.0}, "ttl_s must be a number of seconds between"),
        ({"bucket_bytes": 0}, "bucket_bytes must be a positive number of bytes"),
        ({"bucket_bytes": 1.5}, "bucket_bytes must be a positive number of bytes"),
        ({"bucket_bytes": True}, "bucket_bytes must be a positive number of bytes"),
        ({"path": "disk"}, "publish through disk with DiskPublisher"),
    ],
)
def test_settings_no_push_could_use_are_refused_when_the_publisher_is_built(
    settings: dict[str, object], says: str
) -> None:
    for publisher in (PushPublisher, ShardedPublisher):
        with pytest.raises(ValueError, match=says):
            publisher("http://127.0.0.1:1", **settings)  # type: ignore[arg-type]


def test_a_sharded_publisher_needs_torch_distributed() -> None:
    with pytest.raises(PublishError, match="needs torch.distributed initialised"):
        ShardedPublisher("http://127.0.0.1:1")


def test_the_defaults_and_the_bounds_are_accepted() -> None:
    PushPublisher("http://127.0.0.1:1")
    PushPublisher("http://127.0.0.1:1", timeout_s=3600, ttl_s=0.1, bucket_bytes=1)
