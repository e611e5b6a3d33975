"""Weight versions: how two of them are ordered, in one place for the router, the gate and the audit.

A weight version is a label (SGLang's ``weight_version``). Labels that are plain base-10 integers
("7", "120") are ordered numerically; any other label ("default", "rc-2") is only ever equal or
not equal to another, never older or newer.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# int() alone would also accept "1_000", " 7" and non-ASCII digits, which nobody means as an
# ordered version.
_INTEGER_VERSION = re.compile(r"-?[0-9]{1,30}")


def version_number(version: str | None) -> int | None:
    """``version`` as an int when it is a base-10 integer label, else None (not ordered)."""
    if version is None or not _INTEGER_VERSION.fullmatch(version):
        return None
    return int(version)


def is_newer(version: str, than: str | None) -> bool | None:
    """Whether ``version`` comes after ``than``: None when the two cannot be ordered."""
    a, b = version_number(version), version_number(than)
    if a is None or b is None:
        return None
    return a > b


def at_least(version: str | None, minimum: str) -> bool:
    """Whether ``version`` satisfies ``minimum``: numerically for integer labels, else equality."""
    if version is None:
        return False
    a, b = version_number(version), version_number(minimum)
    if a is None or b is None:
        return version == minimum
    return a >= b


def comparable(version: str | None, minimum: str) -> bool:
    """Whether ``at_least(version, minimum)`` can ever hold for a server at ``version`` once it
    moves on: the two are the same label, or both integers (a later version may reach it)."""
    if version is None:
        return False
    return version == minimum or (version_number(version) is not None and version_number(minimum) is not None)


def newest(versions: Iterable[str | None]) -> str | None:
    """The highest integer label among ``versions``; None when none is an integer."""
    numbered = [(n, v) for v in versions if v is not None and (n := version_number(v)) is not None]
    return max(numbered)[1] if numbered else None
