"""``PushPublisher.share_memory``: a module's weights moved into a shared-memory segment keep their
values, their tensor objects and their ties, train on as before, and leave no segment behind once the
publisher is closed (pushes from them are tested in tests/train/test_push.py)."""

from __future__ import annotations

import asyncio
import os
import socket

import httpx
import pytest
import torch

from miles.errors import PublishError
from miles.train.push import PushPublisher
from miles.weights.checksum import checksum_module
from miles.weights.transport import segments
from miles.weights.transport.segments import Segment

pytestmark = pytest.mark.skipif(not segments.available(), reason="no shared-memory segments on this machine")


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(32, 8)
        self.proj = torch.nn.Linear(8, 8).to(torch.bfloat16)
        self.head = torch.nn.Linear(8, 32, bias=False)
        self.head.weight = self.embed.weight  # tied: one storage, two names
        self.register_buffer("scale", torch.arange(5, dtype=torch.int64)[1:])  # a view at an offset


_BEFORE: set[str] = set()


def _segments() -> set[str]:
    """The segments this process holds a descriptor of (a segment's memory lives on without one
    for as long as a tensor views it)."""
    held = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(f"/memfd:miles-{os.getpid()}-"):
            held.add(target.removeprefix("/memfd:").removesuffix(" (deleted)"))
    return held


@pytest.fixture(autouse=True)
def _segments_before() -> None:
    """Segments of this process's that other tests left open are not this test's."""
    _BEFORE.clear()
    _BEFORE.update(_segments())


def ours() -> set[str]:
    """This process's segments made since the test began and still there."""
    return _segments() - _BEFORE


def test_shared_weights_keep_their_values_objects_and_ties_and_train_on() -> None:
    model = Tied()
    before = checksum_module(model).checksum
    objects = [id(t) for t in (*model.parameters(), *model.buffers())]
    publisher = PushPublisher("http://127.0.0.1:1")
    assert publisher.share_memory(model) is model
    segment = publisher.shared_segment
    assert segment is not None and segment.name in ours()
    assert checksum_module(model).checksum == before
    assert [id(t) for t in (*model.parameters(), *model.buffers())] == objects
    for tensor in (*model.parameters(), *model.buffers()):
        assert segment.offset_of(tensor) is not None, tensor.shape
    assert model.head.weight.data_ptr() == model.embed.weight.data_ptr()
    assert model.scale.tolist() == [1, 2, 3, 4]

    # An optimizer step writes into the segment, the tie holds, and the segment sees it.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loss = model.head(model.embed(torch.tensor([1, 2]))).sum() + model.proj(torch.ones(8, dtype=torch.bfloat16)).sum()
    loss.backward()
    optimizer.step()
    assert checksum_module(model).checksum != before
    at = segment.offset_of(model.embed.weight)
    assert at is not None
    stored = segment.flat[at : at + model.embed.weight.nbytes].view(torch.float32).reshape(32, 8)
    assert torch.equal(stored, model.embed.weight.detach())

    # Closing drops the segment; the model keeps its memory and its values.
    trained = checksum_module(model).checksum
    asyncio.run(publisher.close())
    assert publisher.shared_segment is None and not ours()
    assert checksum_module(model).checksum == trained


def test_sharing_again_moves_replaced_tensors_and_drops_the_old_file() -> None:
    model = Tied()
    publisher = PushPublisher("http://127.0.0.1:1")
    publisher.share_memory(model)
    first = publisher.shared_segment
    assert first is not None
    model.proj.weight = torch.nn.Parameter(torch.ones(8, 8, dtype=torch.bfloat16))  # replaced: not shared
    assert first.offset_of(model.proj.weight) is None
    publisher.share_memory(model)
    second = publisher.shared_segment
    assert second is not None and second.name != first.name
    assert first.name not in ours() and second.name in ours()
    assert all(second.offset_of(t) is not None for t in model.parameters())
    assert torch.equal(model.proj.weight, torch.ones(8, 8, dtype=torch.bfloat16))
    asyncio.run(publisher.close())
    assert not ours()


def test_a_segment_larger_than_the_memory_there_is_is_refused_before_anything_is_taken() -> None:
    too_big = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") + 1
    with pytest.raises(PublishError, match="bytes of shared memory, but .* are available"):
        Segment(too_big)
    assert not ours()


def test_a_model_shared_once_is_not_copied_again_at_the_next_publish() -> None:
    """Whatever its tensors' layout (a transposed view, an empty buffer), a model already in the
    publisher's segment stays there from one publish to the next: sharing is one copy, not one per
    push. (No controller answers here: each publish fails once it has shared, at the window.)"""
    model = Tied()
    model.proj.weight = torch.nn.Parameter(torch.randn(8, 8).to(torch.bfloat16).t())  # not contiguous
    model.register_buffer("nothing", torch.empty(0))
    publisher = PushPublisher(f"http://127.0.0.1:{_closed_port()}", path="shm")
    names = []
    for step in (1, 2):
        with pytest.raises(httpx.HTTPError):
            asyncio.run(publisher.publish(model, None, step=step))  # type: ignore[arg-type]
        assert publisher.shared_segment is not None
        names.append(publisher.shared_segment.name)
    assert names[0] == names[1]
    assert not model.proj.weight.is_contiguous() and publisher.shared_segment.holds(model.proj.weight)
    asyncio.run(publisher.close())
    assert not ours()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
