"""Canonical weight checksums: the same weights give the same checksum from every representation.

Per tensor, the digest is ``miles.weights.digest``'s, over the tensor's raw row-major bytes (what
``tensor.reshape(-1).view(torch.uint8)`` holds and a safetensors file stores), whatever its dtype:
32 lowercase hex characters.

The model checksum is xxh3-128 over this UTF-8 text, with nothing before or after it::

    for every tensor, sorted by name (Unicode code point order, i.e. Python's ``sorted``):
        "{name}\\t{dtype}\\t[{d0},{d1},...]\\t{digest}\\n"

``dtype`` is the torch dtype name without ``torch.`` (``bfloat16``); the shape is the sizes
joined by commas without spaces in brackets (``[]`` for a 0-d tensor). So changing an element, a
dtype, a shape (even with the same bytes) or which name holds which bytes changes the checksum.
Names holding a tab or newline are refused (TensorNameError): they would make the listing ambiguous.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import MappingProxyType
from typing import Final

import torch
import xxhash

from miles.errors import (
    CheckpointFileInvalidError,
    CheckpointFileMissingError,
    TensorNameError,
    UnsupportedTensorError,
)
from miles.weights.digest import digest_buffer
from miles.weights.safetensors_io import SafetensorsFile, TensorSlot, dtype_name, index_files

# The digest of ``miles.weights.digest`` (256 KiB chunks) combined as above.
ALGORITHM: Final = "xxh3_128_chunked"

# xxhash releases the GIL, so large models hash on several threads; below this many bytes a
# thread pool costs more than it saves.
_PARALLEL_MIN_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class TensorDigest:
    """One tensor's line in the canonical listing."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    digest: str

    def canonical_line(self) -> str:
        """This tensor's line of the canonical listing (see the module docstring)."""
        if not self.name or any(c in self.name for c in "\t\n\r"):
            raise TensorNameError("tensor name is empty or holds a tab or newline", tensor=self.name)
        dims = ",".join(str(d) for d in self.shape)
        return f"{self.name}\t{self.dtype}\t[{dims}]\t{self.digest}\n"


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelChecksum:
    """The checksum of a set of named tensors, with the per-tensor digests it was built from."""

    checksum: str
    algorithm: str = ALGORITHM
    tensors: Mapping[str, TensorDigest] = field(default_factory=lambda: MappingProxyType({}))
    num_bytes: int = 0


def default_threads() -> int:
    return min(8, os.cpu_count() or 1)


def digest_tensor(tensor: torch.Tensor) -> str:
    """The digest of ``tensor``'s raw bytes, zero-copy for a contiguous CPU tensor. Raises
    UnsupportedTensorError for a tensor that is not dense and strided, or on the meta device."""
    if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_nested:
        raise UnsupportedTensorError(
            "only dense strided tensors have a canonical byte layout", layout=str(tensor.layout)
        )
    if tensor.device.type == "meta":
        raise UnsupportedTensorError("a meta tensor holds no data to hash", shape=tuple(tensor.shape))
    # Lazy conjugation / negation bits are not in the bytes; materialise them.
    t = tensor.detach().cpu().resolve_conj().resolve_neg().contiguous()
    return digest_buffer(t.reshape(-1).view(torch.uint8).numpy())


def combine_digests(digests: Iterable[TensorDigest]) -> str:
    """The model checksum of ``digests`` (their canonical listing, sorted by name). Raises
    TensorNameError for a name that is empty, holds a tab or newline, or appears twice."""
    hasher = xxhash.xxh3_128()
    previous: str | None = None
    for entry in sorted(digests, key=lambda d: d.name):
        if entry.name == previous:
            raise TensorNameError("tensor name appears twice in one checksum", tensor=entry.name)
        previous = entry.name
        hasher.update(entry.canonical_line().encode("utf-8"))
    return hasher.hexdigest()


def _resolve_threads(threads: int | None) -> int:
    if threads is None:
        return default_threads()
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    return threads


def _run_digests(jobs: Sequence[tuple[int, Callable[[], str]]], threads: int) -> list[str]:
    """Run ``(nbytes, job)`` pairs, in order of the result; on a pool when worth it."""
    total = sum(nbytes for nbytes, _ in jobs)
    if threads == 1 or len(jobs) < 2 or total < _PARALLEL_MIN_BYTES:
        return [job() for _, job in jobs]
    # Largest first, so one huge tensor (the embedding) does not start last and run alone.
    order = sorted(range(len(jobs)), key=lambda i: jobs[i][0], reverse=True)
    with ThreadPoolExecutor(max_workers=min(threads, len(jobs)), thread_name_prefix="miles-hash") as pool:
        futures = {i: pool.submit(jobs[i][1]) for i in order}
        results = {i: future.result() for i, future in futures.items()}
    return [results[i] for i in range(len(jobs))]


def checksum_from_digests(digests: Sequence[TensorDigest], *, num_bytes: int) -> ModelChecksum:
    """``digests`` combined into a ModelChecksum; raises as ``combine_digests``."""
    return ModelChecksum(
        checksum=combine_digests(digests),
        tensors=MappingProxyType({d.name: d for d in sorted(digests, key=lambda d: d.name)}),
        num_bytes=num_bytes,
    )


def checksum_state_dict(state: Mapping[str, torch.Tensor], *, threads: int | None = None) -> ModelChecksum:
    """The checksum of every tensor in ``state`` under its name there (aliases included). Raises
    TensorNameError for a name the listing cannot hold, UnsupportedTensorError for a value that is
    not a dense strided tensor, ValueError for ``threads`` < 1."""
    items = list(state.items())
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise UnsupportedTensorError("state dict value is not a tensor", tensor=name, type=type(tensor).__name__)
    jobs = [(t.numel() * t.element_size(), (lambda t=t: digest_tensor(t))) for _, t in items]
    hexes = _run_digests(jobs, _resolve_threads(threads))
    digests = [
        TensorDigest(name=name, dtype=dtype_name(t.dtype), shape=tuple(t.shape), digest=h)
        for (name, t), h in zip(items, hexes, strict=True)
    ]
    return checksum_from_digests(digests, num_bytes=sum(n for n, _ in jobs))


def checksum_module(module: torch.nn.Module) -> ModelChecksum:
    """The checksum of ``module``'s state dict as Hugging Face ``save_pretrained`` writes it (tied tensors
    once), so a live model and its saved checkpoint agree. Raises as ``checksum_state_dict``."""
    return checksum_state_dict(saved_state_dict(module))


def saved_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` without the aliases and ignored keys ``save_pretrained`` drops."""
    state = dict(module.state_dict())
    for key in getattr(module, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    groups: dict[tuple[object, ...], list[str]] = {}
    for name, tensor in state.items():
        if isinstance(tensor, torch.Tensor) and tensor.numel() > 0:
            groups.setdefault(_view_identity(tensor), []).append(name)
    patterns = _tied_target_patterns(module)
    for names in groups.values():
        if len(names) > 1:
            for name in _aliases_to_drop(names, patterns):
                del state[name]
    return state


def _view_identity(tensor: torch.Tensor) -> tuple[object, ...]:
    # Two names alias when they view exactly the same memory the same way; overlapping but
    # different views (a fused weight split in parts) are separate tensors in the files too.
    # A sharded tensor (a DTensor: no storage of its own) is told apart by this rank's shard.
    if hasattr(tensor, "to_local"):
        tensor = tensor.to_local()
    return (
        tensor.device,
        tensor.dtype,
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tensor.stride(),
    )


def _tied_target_patterns(module: torch.nn.Module) -> list[str]:
    patterns: list[str] = []
    for prefix, submodule in module.named_modules():
        tied = getattr(submodule, "_tied_weights_keys", None) or ()
        # transformers 5 maps target -> source; older versions list the targets.
        targets = tied.keys() if isinstance(tied, Mapping) else tied
        patterns.extend(f"{prefix}.{key}" if prefix else key for key in targets)
    return patterns


def _aliases_to_drop(names: list[str], patterns: list[str]) -> list[str]:
    # Mirrors transformers' remove_tied_weights_from_state_dict, so we keep the name it keeps: the
    # names matching a _tied_weights_keys target are dropped (keeping at least one, the last in
    # sorted order); of several left, the first in state-dict order stays.
    matched = [n for n in sorted(names) if any(re.search(p, n) for p in patterns)]
    drop = matched[: len(names) - 1] if len(matched) == len(names) else matched
    rest = [n for n in names if n not in drop]
    return drop + rest[1:]


def digest_files(
    slots: Sequence[tuple[SafetensorsFile, TensorSlot]], *, threads: int | None = None
) -> list[TensorDigest]:
    """The digests of tensors in safetensors files; raises ValueError for ``threads`` < 1."""
    hexes = _run_digests([(slot.nbytes, partial(m.digest, slot)) for m, slot in slots], _resolve_threads(threads))
    return [
        TensorDigest(name=slot.name, dtype=dtype_name(slot.dtype), shape=slot.shape, digest=h)
        for (_, slot), h in zip(slots, hexes, strict=True)
    ]


def checksum_safetensors(paths_or_dir: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]) -> ModelChecksum:
    """The checksum of the tensors in a safetensors file, several, or a directory (the files
    ``from_pretrained`` would load). Raises CheckpointFileMissingError, CheckpointFileTruncatedError
    or CheckpointFileInvalidError (a file missing, cut or malformed, or a tensor name in two files)."""
    if isinstance(paths_or_dir, str | os.PathLike):
        single = Path(paths_or_dir)
        paths = index_files(single) if single.is_dir() else [single]
        if not paths:
            raise CheckpointFileMissingError("directory holds no safetensors files", path=str(single))
    else:
        paths = [Path(p) for p in paths_or_dir]
        if not paths:
            raise CheckpointFileMissingError("no safetensors files given")
    return checksum_files(paths)[0]


def checksum_files(paths: Sequence[Path]) -> tuple[ModelChecksum, dict[str, Path]]:
    """The checksum of the tensors in the safetensors files ``paths``, and the file of each tensor;
    raises as ``checksum_safetensors``."""
    with ExitStack() as stack:
        slots = collect_slots([stack.enter_context(SafetensorsFile(p)) for p in paths])
        digests = digest_files(slots)
    owners = {slot.name: mapped.path for mapped, slot in slots}
    return checksum_from_digests(digests, num_bytes=sum(slot.nbytes for _, slot in slots)), owners


def model_checksum(source: torch.nn.Module | str | os.PathLike[str]) -> str:
    """The checksum of a model in memory or of a checkpoint directory (the same for the same
    weights); raises as ``checksum_module`` and ``checksum_safetensors``."""
    if isinstance(source, torch.nn.Module):
        return checksum_module(source).checksum
    return checksum_safetensors(source).checksum


def collect_slots(files: Iterable[SafetensorsFile]) -> list[tuple[SafetensorsFile, TensorSlot]]:
    """Every tensor of ``files`` with its file; CheckpointFileInvalidError for a name in two files."""
    slots: list[tuple[SafetensorsFile, TensorSlot]] = []
    owner: dict[str, Path] = {}
    for mapped in files:
        for name, slot in mapped.tensors.items():
            if name in owner:
                raise CheckpointFileInvalidError(
                    "tensor appears in two safetensors files",
                    tensor=name,
                    first=str(owner[name]),
                    second=str(mapped.path),
                )
            owner[name] = mapped.path
            slots.append((mapped, slot))
    return slots
