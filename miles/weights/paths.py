"""Checkpoint paths from the outside world, checked before any filesystem call sees them.

A path in a request is text an attacker chooses: ``os`` functions raise on a NUL byte or an
over-long name, which an HTTP handler would turn into a 500; this module refuses such text first,
saying what is wrong.
"""

from __future__ import annotations

import os
from pathlib import Path

from miles.errors import InvalidRequestError

# Linux's PATH_MAX and NAME_MAX: longer text cannot name a file here, whatever it says.
MAX_PATH_CHARS = 4096
MAX_NAME_BYTES = 255


def path_text_problem(raw: str) -> str | None:
    """What makes ``raw`` unusable as a path, or None; no filesystem call is made."""
    if not raw or not raw.strip():
        return "is empty; give a checkpoint directory"
    if "\x00" in raw:
        return "contains a NUL byte; give a plain directory path"
    if len(raw) > MAX_PATH_CHARS:
        return f"is {len(raw)} characters long; a path here has at most {MAX_PATH_CHARS}"
    for part in Path(raw).parts:
        if len(os.fsencode(part)) > MAX_NAME_BYTES:
            return f"has a component of more than {MAX_NAME_BYTES} bytes ({part[:40]!r}...); no file can have that name"
    return None


def checked_path(raw: str, *, field: str) -> Path:
    """``raw`` as an absolute, resolved Path (``~`` expanded, symlinks followed). Raises
    InvalidRequestError naming ``field`` for text ``path_text_problem`` refuses, or a path that
    cannot be resolved (a symlink loop)."""
    problem = path_text_problem(raw)
    if problem is not None:
        raise InvalidRequestError(f"{field} {problem}")
    try:
        return Path(raw).expanduser().resolve()
    except (OSError, RuntimeError, ValueError) as exc:
        raise InvalidRequestError(f"{field} cannot be resolved: {exc}") from exc


def inside_roots(path: Path, roots: tuple[Path, ...]) -> bool:
    """Whether resolved ``path`` lies inside one of ``roots`` (no roots: anywhere)."""
    return not roots or any(path.is_relative_to(root) for root in roots)


def files_outside_roots(directory: Path, roots: tuple[Path, ...], *, limit: int = 10_000) -> list[str]:
    """The entries of checkpoint ``directory`` (recursively, at most ``limit``) that resolve
    outside every root, relative to it: a file in a root may be a symlink to anywhere
    (``model.safetensors -> /etc/shadow``). Empty when there are no roots."""
    if not roots:
        return []
    outside: list[str] = []
    for seen, entry in enumerate(directory.rglob("*")):
        if seen >= limit:
            outside.append(f"(more than {limit} entries; a checkpoint directory is not that large)")
            break
        try:
            escapes = not inside_roots(entry.resolve(), roots)
        except (OSError, RuntimeError):  # a symlink loop or an unreadable entry counts as outside
            escapes = True
        if escapes:
            outside.append(entry.relative_to(directory).as_posix())
    return outside


def roots_problem(path: Path, roots: tuple[Path, ...]) -> str | None:
    """Why checkpoint ``path`` (resolved) may not be read under the allowed checkpoint ``roots``:
    it, or an entry in it, resolves outside every root; None when it may (or there are no roots).
    Every path that is read as a checkpoint or becomes a restart point passes it."""
    if not inside_roots(path, roots):
        return (
            f"checkpoint {path} is outside the allowed checkpoint roots ({', '.join(map(str, roots))}); "
            "move it under one of them or extend MILES_ALLOWED_CHECKPOINT_ROOTS"
        )
    try:
        escaping = files_outside_roots(path, roots)
    except OSError as exc:  # e.g. a resolved path longer than the system allows
        return f"checkpoint {str(path)[:200]!r} cannot be listed to check where its files lead: {exc.strerror}"
    if escaping:
        return (
            f"checkpoint {path} has entries that resolve outside the allowed checkpoint roots "
            f"({', '.join(escaping[:5])}{' ...' if len(escaping) > 5 else ''}); copy the files in instead "
            "of linking to them, or extend MILES_ALLOWED_CHECKPOINT_ROOTS"
        )
    return None
