"""Checksum throughput next to its floors: SHA-256 and a plain memory copy, on the same bytes.

    python benchmarks/checksum.py [--gib 1.0] [--repeats 3]

Builds ~``--gib`` GiB of bfloat16 tensors shaped like a transformer's (embedding, per-layer
attention and MLP matrices, biases, norms: a few hundred tensors), then measures, best of
``--repeats``: ``checksum_state_dict`` (default threads and 1 thread), ``checksum_safetensors`` on
the same tensors saved to a temp file (page cache warm), ``hashlib.sha256`` over the same bytes,
and ``Tensor.copy_`` into preallocated tensors. Prints GB/s (1e9 bytes) and the ratios
ours / sha256 and ours / memcpy (targets: >= 10x and >= 0.5x).

Then copying and checksumming in one pass, on one thread (``miles.weights.digest.copy_and_digest``: what loading,
staging and packing a push do): the copy and the hash made one after the other over the whole
tensors, and one pass slice by slice, at the slice size the code uses and at others, each as a
ratio to the code's.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

import miles.weights.digest as digest_module
from miles.utils.progress_bars import disable_library_progress_bars
from miles.weights.checksum import checksum_safetensors, checksum_state_dict, default_threads

_HIDDEN = 1024
_KV = 256
_INTERMEDIATE = 2816
_VOCAB = 32000


@dataclass(frozen=True)
class Measurement:
    name: str
    seconds: float
    num_bytes: int

    @property
    def gbps(self) -> float:
        return self.num_bytes / self.seconds / 1e9


def build_tensors(gib: float, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """About ``gib`` GiB of random bf16 tensors laid out like a Qwen2-style decoder."""
    layer = {
        "self_attn.q_proj.weight": (_HIDDEN, _HIDDEN),
        "self_attn.q_proj.bias": (_HIDDEN,),
        "self_attn.k_proj.weight": (_KV, _HIDDEN),
        "self_attn.k_proj.bias": (_KV,),
        "self_attn.v_proj.weight": (_KV, _HIDDEN),
        "self_attn.v_proj.bias": (_KV,),
        "self_attn.o_proj.weight": (_HIDDEN, _HIDDEN),
        "mlp.gate_proj.weight": (_INTERMEDIATE, _HIDDEN),
        "mlp.up_proj.weight": (_INTERMEDIATE, _HIDDEN),
        "mlp.down_proj.weight": (_HIDDEN, _INTERMEDIATE),
        "input_layernorm.weight": (_HIDDEN,),
        "post_attention_layernorm.weight": (_HIDDEN,),
    }
    per_layer = sum(torch.Size(s).numel() for s in layer.values()) * 2
    fixed = 2 * _VOCAB * _HIDDEN * 2 + _HIDDEN * 2
    layers = max(1, round((gib * 2**30 - fixed) / per_layer))
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (_VOCAB, _HIDDEN)}
    for i in range(layers):
        shapes.update({f"model.layers.{i}.{name}": shape for name, shape in layer.items()})
    shapes["model.norm.weight"] = (_HIDDEN,)
    shapes["lm_head.weight"] = (_VOCAB, _HIDDEN)
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator, dtype=torch.bfloat16) for name, shape in shapes.items()}


def best_of(repeats: int, fn: Callable[[], object]) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def sha256_all(tensors: dict[str, torch.Tensor]) -> None:
    for t in tensors.values():
        hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0, help="GiB of tensors (default 1.0)")
    parser.add_argument("--repeats", type=int, default=3, help="best of N runs (default 3)")
    args = parser.parse_args()

    tensors = build_tensors(args.gib)
    num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    print(
        f"{len(tensors)} bf16 tensors, {num_bytes / 2**30:.2f} GiB; {os.cpu_count()} CPUs, "
        f"default threads {default_threads()}, torch threads {torch.get_num_threads()}"
    )
    results: list[Measurement] = []

    def measure(name: str, fn: Callable[[], object]) -> None:
        results.append(Measurement(name, best_of(args.repeats, fn), num_bytes))

    measure(f"checksum_state_dict (threads={default_threads()})", lambda: checksum_state_dict(tensors))
    measure("checksum_state_dict (threads=1)", lambda: checksum_state_dict(tensors, threads=1))
    with tempfile.TemporaryDirectory(prefix="miles-bench-") as tmp:
        path = Path(tmp) / "model.safetensors"
        save_file(tensors, str(path))
        reference = checksum_state_dict(tensors).checksum
        if checksum_safetensors(path).checksum != reference:  # also warms the page cache
            raise SystemExit("file and memory checksums differ: the benchmark is measuring a bug")
        measure(f"checksum_safetensors (threads={default_threads()})", lambda: checksum_safetensors(path))
    measure("hashlib.sha256", lambda: sha256_all(tensors))
    destination = {name: torch.empty_like(t) for name, t in tensors.items()}
    measure(
        "memcpy (Tensor.copy_)",
        lambda: [destination[name].copy_(t) for name, t in tensors.items()],
    )

    sha = next(r for r in results if r.name == "hashlib.sha256")
    memcpy = next(r for r in results if r.name.startswith("memcpy"))
    print(f"\n{'what':<40} {'best s':>8} {'GB/s':>8} {'x sha256':>9} {'x memcpy':>9}")
    for r in results:
        ours = r.name.startswith("checksum")
        ratio_sha = f"{r.gbps / sha.gbps:9.1f}" if ours else f"{'':>9}"
        ratio_copy = f"{r.gbps / memcpy.gbps:9.2f}" if ours else f"{'':>9}"
        print(f"{r.name:<40} {r.seconds:8.3f} {r.gbps:8.2f} {ratio_sha} {ratio_copy}")
    copy_and_hash(tensors, destination, args.repeats, num_bytes)


def copy_and_hash(
    tensors: dict[str, torch.Tensor], destination: dict[str, torch.Tensor], repeats: int, num_bytes: int
) -> None:
    """One thread copying and checksumming: two passes, then one pass at several slice sizes."""
    shipped = digest_module.COPY_SLICE_BYTES
    rows = [
        (
            "copy, then checksum (two passes)",
            best_of(
                repeats,
                lambda: (
                    [destination[name].copy_(t) for name, t in tensors.items()],
                    checksum_state_dict(destination, threads=1),
                ),
            ),
        )
    ]
    for size in sorted({64 << 10, 256 << 10, 1 << 20, 4 << 20, shipped}):
        digest_module.COPY_SLICE_BYTES = size
        try:
            seconds = best_of(
                repeats,
                lambda: [digest_module.copy_and_digest(destination[name], t) for name, t in tensors.items()],
            )
        finally:
            digest_module.COPY_SLICE_BYTES = shipped
        label = f"one pass, {size >> 10} KiB slices" + (" (the code's)" if size == shipped else "")
        rows.append((label, seconds))
    ours = next(seconds for label, seconds in rows if "the code's" in label)
    print(f"\n{'copy and checksum, 1 thread':<40} {'best s':>8} {'GB/s':>8} {'t / ours':>9}")
    for label, seconds in rows:
        print(f"{label:<40} {seconds:8.3f} {num_bytes / seconds / 1e9:8.2f} {seconds / ours:9.2f}")


if __name__ == "__main__":
    disable_library_progress_bars()  # the benchmark prints its own figures, not transformers' bars
    main()
