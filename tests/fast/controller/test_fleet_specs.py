"""How server specs become a fleet: which specs serve one model together (a MixedRollout of several
server types), how its servers are named, what is refused by name, and what the mix answers for the
model as a whole. The fleet is built, never started: no process runs."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from miles.config import ControllerSettings, RoutingPolicy
from miles.controller.fleet import Fleet, normalize_specs
from miles.controller.router import NoServerAvailableError, Router
from miles.errors import InvalidRequestError
from miles.models.presets import init_checkpoint
from miles.rollout.mixed import MixedRollout
from miles.rollout.rollout import Rollout
from miles.rollout.state import RolloutError, ServerSnapshot, ServerState, StateChange, VerifiedWeights
from miles.testing import server_snapshot

SFT = "SFTRollout"
VLLM = "VLLMRollout"
# A vLLM spec is only built here, never launched: any interpreter file will do.
VLLM_ARGS = {"python": sys.executable}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two checkpoints of model ``tiny`` (different weights) and one of ``tiny-b``."""
    root = tmp_path_factory.mktemp("fleet-specs")
    for name, model, seed in (("a", "tiny", 0), ("a2", "tiny", 1), ("b", "tiny-b", 2)):
        init_checkpoint(root / name, model_name=model, preset="tiny", seed=seed, step=1)
    return {name: root / name for name in ("a", "a2", "b")}


class Recorder:
    """A RolloutObserver that keeps what it is told."""

    def __init__(self) -> None:
        self.written_out: list[tuple[str, str, Path]] = []

    def state_changed(self, change: StateChange) -> None:
        pass

    def weights_restored(self, server_id: str, model_name: str, verified: VerifiedWeights) -> None:
        pass

    def weights_written_out(self, model_name: str, checksum: str, checkpoint: Path) -> None:
        self.written_out.append((model_name, checksum, checkpoint))

    def probed(self, server_id: str) -> None:
        pass

    def drifted(self, server_id: str, model_name: str, *, expected: VerifiedWeights, actual: Any) -> None:
        pass


@contextlib.asynccontextmanager
async def _unguarded(_: str) -> AsyncIterator[int | None]:
    yield None


@contextlib.contextmanager
def built(
    raw: Any, tmp_path: Path, *, checkpoint: Path | None = None, observer: Recorder | None = None
) -> Iterator[Fleet]:
    specs = normalize_specs(raw, checkpoint, 2)
    settings = ControllerSettings(state_dir=tmp_path / "state")
    yield Fleet(specs, settings=settings, exclusive=_unguarded, observer=observer or Recorder())


def resolve(value: Any, ckpts: dict[str, Path]) -> Any:
    """A spec table's "@a" names the checkpoint ``a``."""
    if isinstance(value, dict):
        return {k: resolve(v, ckpts) for k, v in value.items()}
    if isinstance(value, str) and value.startswith("@"):
        return ckpts[value[1:]]
    return value


# What each accepted configuration serves: model -> [(server id, server type, engine API)], and
# which of its models are served by several specs (a MixedRollout).
ACCEPTED = [
    pytest.param(
        SFT,
        {"tiny": [("tiny-0", SFT, "sglang"), ("tiny-1", SFT, "sglang")]},
        set(),
        id="the seed's dotted path or short name: one model, its servers named after it",
    ),
    pytest.param(
        {"one": {"cls": SFT, "checkpoint": "@a"}, "two": {"cls": VLLM, "checkpoint": "@b", "vllm": VLLM_ARGS}},
        {"tiny": [("tiny-0", SFT, "sglang")], "tiny-b": [("tiny-b-0", VLLM, "vllm")]},
        set(),
        id="two models of two server types",
    ),
    pytest.param(
        {
            "policy-embedded": {"cls": SFT, "checkpoint": "@a", "model_name": "policy", "num_servers": 1},
            "policy-vllm": {"cls": VLLM, "checkpoint": "@a", "model_name": "policy", "vllm": VLLM_ARGS},
        },
        {"policy": [("policy-embedded-0", SFT, "sglang"), ("policy-vllm-0", VLLM, "vllm")]},
        {"policy"},
        id="one model on embedded engines and vLLM servers: servers named after the specs",
    ),
    pytest.param(
        {"e": {"cls": SFT, "checkpoint": "@a", "num_servers": 2}, "v": {"cls": VLLM, "checkpoint": "@a"}},
        {"tiny": [("e-0", SFT, "sglang"), ("e-1", SFT, "sglang"), ("v-0", VLLM, "vllm")]},
        {"tiny"},
        id="specs without model_name on one checkpoint serve the model its manifest names",
    ),
    pytest.param(
        {
            "local": {"cls": SFT, "checkpoint": "@a", "model_name": "m"},
            "theirs": {"cls": VLLM, "checkpoint": "@a", "model_name": "m", "urls": ["http://127.0.0.1:9"]},
        },
        {"m": [("local-0", SFT, "sglang"), ("theirs-0", VLLM, "vllm")]},
        {"m"},
        id="launched servers beside attached ones",
    ),
    pytest.param(
        {
            "small-cpu": {"cls": SFT, "checkpoint": "@a", "model_name": "m", "num_threads": 1},
            "big-cpu": {"cls": SFT, "checkpoint": "@a", "model_name": "m", "num_threads": 2},
        },
        {"m": [("small-cpu-0", SFT, "sglang"), ("big-cpu-0", SFT, "sglang")]},
        {"m"},
        id="two specs of one server type, set up differently",
    ),
]


@pytest.mark.parametrize(("raw", "served", "mixed"), ACCEPTED)
def test_accepted_specs_and_what_they_serve(
    raw: Any, served: dict[str, Any], mixed: set[str], ckpts, tmp_path: Path
) -> None:
    raw = resolve(raw, ckpts)
    with built(raw, tmp_path, checkpoint=None if isinstance(raw, dict) else ckpts["a"]) as fleet:
        assert fleet.model_names == list(served)
        for model, servers in served.items():
            rollout = fleet.rollout(model)
            assert isinstance(rollout, MixedRollout if model in mixed else Rollout)
            assert [(s.server_id, s.server_type, s.engine) for s in rollout.snapshot()] == servers
            assert all(s.model_name == model for s in rollout.snapshot())


REFUSED = [
    pytest.param(
        {"x": {"cls": SFT, "checkpoint": "@a"}, "y": {"cls": VLLM, "checkpoint": "@a2", "vllm": VLLM_ARGS}},
        "server specs 'x' and 'y' both serve model 'tiny' but start on different checkpoints",
        id="one model on two checkpoints (other weights, perhaps another architecture)",
    ),
    pytest.param(
        {
            "x": {"cls": SFT, "checkpoint": "@a", "model_name": "m"},
            "y": {"cls": SFT, "checkpoint": "@b", "model_name": "m"},
        },
        "start every spec of the model on one checkpoint, or give each spec its own model_name",
        id="one model_name given to two models",
    ),
    pytest.param(
        {
            "first": {"cls": SFT, "checkpoint": "@b", "model_name": "x-y"},
            "x-y": {"cls": SFT, "checkpoint": "@a", "model_name": "m"},
            "z": {"cls": SFT, "checkpoint": "@a", "model_name": "m"},
        },
        "server spec 'x-y' would name a server 'x-y-0', as another spec does",
        id="a spec named like another model: server ids would collide",
    ),
    pytest.param(
        {"!!": {"cls": SFT, "checkpoint": "@a"}, "ok": {"cls": SFT, "checkpoint": "@a"}},
        "'!!' has no character a server id can use",
        id="a spec of a mixed model whose name cannot name servers",
    ),
    pytest.param(
        {
            "x": {"cls": VLLM, "checkpoint": "@a", "urls": ["http://127.0.0.1:9"]},
            "y": {"cls": VLLM, "checkpoint": "@a", "urls": ["http://127.0.0.1:9"]},
        },
        "attaches http://127.0.0.1:9, which another spec attaches too",
        id="one attached server given to two specs",
    ),
    pytest.param(
        {"x": {"cls": SFT, "checkpoint": "@a", "vllm": VLLM_ARGS}, "y": {"cls": VLLM, "checkpoint": "@a"}},
        "server spec 'x': 'vllm' launch arguments are for VLLMRollout, not SFTRollout",
        id="vLLM's arguments on an embedded spec of a mixed model",
    ),
    pytest.param(
        {"x": {"cls": SFT, "checkpoint": "@a", "urls": ["http://127.0.0.1:9"]}},
        "SFTRollout launches its own servers and cannot attach to urls",
        id="an embedded spec that attaches",
    ),
]


@pytest.mark.parametrize(("raw", "message"), REFUSED)
def test_refused_specs_name_what_is_wrong(raw: Any, message: str, ckpts, tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError) as refused, built(resolve(raw, ckpts), tmp_path):
        pass
    assert message in str(refused.value)


def test_a_mixed_model_answers_for_the_whole_model(ckpts, tmp_path: Path) -> None:
    observer = Recorder()
    raw = {
        "e": {"cls": SFT, "checkpoint": ckpts["a"], "model_name": "m"},
        "v": {"cls": VLLM, "checkpoint": ckpts["a"], "model_name": "m", "vllm": VLLM_ARGS},
    }
    with built(raw, tmp_path, observer=observer) as fleet:
        mixed = fleet.rollout("m")
        assert isinstance(mixed, MixedRollout)
        embedded, vllm = mixed.rollouts
        assert mixed.start_checkpoint == ckpts["a"].resolve()
        # A vLLM server cannot stage a window's pushes, so the model's windows are not staged.
        assert not mixed.stages_pushes and embedded.stages_pushes
        # Each server's calls go to the rollout that runs it; an id of no server is refused.
        assert mixed.owner("e-0") is embedded and mixed.owner("v-0") is vllm
        with pytest.raises(RolloutError, match="no such server of this model"):
            mixed.cell("tiny-0")
        # Resuming sets where every rollout starts.
        resumed = VerifiedWeights(checkpoint=ckpts["a"], weight_version="7", checksum="c7", step=7)
        mixed.resume_from = resumed
        assert embedded.resume_from == vllm.resume_from == resumed
        # Pushed weights written out by one server are where every server verified on them reloads
        # from, whatever its type; the copy is reported once.
        pushed = VerifiedWeights(checkpoint=None, weight_version="8", checksum="c8", step=8)
        for rollout, server_id in ((embedded, "e-0"), (vllm, "v-0")):
            rollout.cell(server_id).verified = pushed
        copy = tmp_path / "copy"
        assert mixed.remember_checkpoint("c8", copy) == ["e-0", "v-0"]
        assert {s.verified.checkpoint for s in mixed.snapshot() if s.verified} == {copy}
        assert observer.written_out == [("m", "c8", copy)]
        # A restart of either looks for a peer among the servers of both types.
        for state in (ServerState.STARTING, ServerState.PENDING_WEIGHTS, ServerState.SERVING):
            embedded.transition(embedded.cell("e-0"), state, "as a start would")
        peer = vllm.peer_holding(vllm.cell("v-0"))
        assert peer is not None and peer.server_id == "e-0"


def snap(server_id: str, engine: str, state: ServerState = ServerState.SERVING) -> ServerSnapshot:
    return server_snapshot(server_id, state=state, engine=engine)


async def test_the_router_spreads_a_mixed_model_and_keeps_a_shaped_request_to_its_engines() -> None:
    servers = [snap("e-0", "sglang"), snap("v-0", "vllm")]
    router = Router(servers=lambda _: servers, policy=lambda: RoutingPolicy.ROUND_ROBIN)
    picked = set()
    for _ in range(4):
        lease = await router.acquire("m", timeout_s=1)
        picked.add((lease.server_id, lease.engine))
        router.release(lease)
    assert picked == {("e-0", "sglang"), ("v-0", "vllm")}
    for engine, only in (("sglang", "e-0"), ("vllm", "v-0")):
        lease = await router.acquire("m", timeout_s=1, engine=engine)
        assert lease.server_id == only
        router.release(lease)
    servers[1] = snap("v-0", "vllm", ServerState.UPDATING)
    with pytest.raises(NoServerAvailableError, match=r"v-0=updating"):
        await router.acquire("m", timeout_s=0.05, engine="vllm")
