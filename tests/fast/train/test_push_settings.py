"""PushPublisher refuses settings the controller or the engines would refuse in the middle of a
push, when it is built (the pushes themselves are tested in tests/train/test_push.py)."""

from __future__ import annotations

import math

import pytest

from miles.train.push import PushPublisher


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
    with pytest.raises(ValueError, match=says):
        PushPublisher("http://127.0.0.1:1", **settings)  # type: ignore[arg-type]


def test_the_defaults_and_the_bounds_are_accepted() -> None:
    PushPublisher("http://127.0.0.1:1")
    PushPublisher("http://127.0.0.1:1", timeout_s=3600, ttl_s=0.1, bucket_bytes=1)
