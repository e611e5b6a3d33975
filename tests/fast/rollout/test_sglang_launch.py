"""What SGLangRollout sends an SGLang server, checked by SGLang's own code at the pinned version.

The launch command lines are parsed by SGLang's ``ServerArgs`` parser and made into its
``ServerArgs``; the request bodies the client sends are read by SGLang's request classes
(``io_struct.py``); the endpoints it calls must be routes of SGLang's HTTP server. A flag, field
or endpoint that SGLang renames or removes fails here. SGLang runs in a separate process
(``sglang_reference.py``): its source from ``.sglang-ref`` and msgspec from ``.sglang-deps``
(``make test`` installs both), its GPU-only imports stubbed there.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from miles.protocol.sglang import AbortRequest, ContinueGenerationRequest, PauseGenerationRequest, PauseMode
from miles.protocol.sglang_weights import (
    DestroyWeightsUpdateGroupRequest,
    InitWeightsUpdateGroupRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
    UpdateWeightVersionRequest,
    WeightsCheckerRequest,
)
from miles.rollout.rollout import RolloutError
from miles.rollout.runtime import LaunchSlot, Placement
from miles.rollout.sglang_rollout import MILES_FLAGS, SGLangLaunchCommand, check_engine_args
from miles.rollout.spec import SGLangServerArgs

HERE = Path(__file__).parent
REPO = HERE.parents[2]
REF = REPO / ".sglang-ref"
DEPS = REPO / ".sglang-deps"


def slot(*, gpu_ids: tuple[int, ...] = (), port: int = 31000) -> LaunchSlot:
    placement = Placement(node_id="n", node_address="10.0.0.5", gpu_ids=gpu_ids, device="cuda" if gpu_ids else "cpu")
    return LaunchSlot(host="10.0.0.5", port=port, placement=placement, work_dir=Path("/tmp/w"))


# (what the user gives, the slot the runtime gave, the ServerArgs SGLang must make of the command)
LAUNCHES: list[tuple[SGLangServerArgs, tuple[str, ...], LaunchSlot, dict[str, Any]]] = [
    (
        SGLangServerArgs(),
        (),
        slot(),
        {"tp_size": 1, "dp_size": 1, "base_gpu_id": 0, "mem_fraction_static": None, "context_length": None},
    ),
    (
        SGLangServerArgs(tp_size=2, dp_size=2, mem_fraction_static=0.7, context_length=4096),
        ("--chunked-prefill-size", "8192"),
        slot(gpu_ids=(4, 5, 6, 7), port=31007),
        {
            "tp_size": 2,
            "dp_size": 2,
            "base_gpu_id": 4,
            "mem_fraction_static": 0.7,
            "context_length": 4096,
            "chunked_prefill_size": 8192,
            "port": 31007,
        },
    ),
]

# (our request as the client sends it, SGLang's class, the miles extensions SGLang ignores)
REQUESTS: list[tuple[BaseModel, str, set[str]]] = [
    (
        UpdateWeightsFromDiskRequest(model_path="/ckpt/step-2", weight_version="2", expected_checksum="ab" * 16),
        "UpdateWeightFromDiskReqInput",
        {"expected_checksum"},
    ),
    (UpdateWeightVersionRequest(new_version="3", abort_all_requests=False), "UpdateWeightVersionReqInput", set()),
    (PauseGenerationRequest(mode=PauseMode.ABORT), "PauseGenerationReqInput", set()),
    (PauseGenerationRequest(mode=PauseMode.RETRACT), "PauseGenerationReqInput", set()),
    (PauseGenerationRequest(mode=PauseMode.IN_PLACE), "PauseGenerationReqInput", set()),
    (ContinueGenerationRequest(), "ContinueGenerationReqInput", set()),
    (AbortRequest(rid="r-1", abort_message="superseded"), "AbortReq", set()),
    (AbortRequest(abort_all=True), "AbortReq", set()),
    (WeightsCheckerRequest(), "CheckWeightsReqInput", set()),
    (
        InitWeightsUpdateGroupRequest(master_address="10.0.0.1", master_port=29500, rank_offset=1, world_size=3),
        "InitWeightsUpdateGroupReqInput",
        {"timeout_s"},
    ),
    (
        UpdateWeightsFromDistributedRequest(
            names=["w"], dtypes=["bfloat16"], shapes=[[2, 2]], load_format="flattened_bucket", weight_version="4"
        ),
        "UpdateWeightsFromDistributedReqInput",
        {"digests", "timeout_s", "expected_checksum", "activate"},
    ),
    (
        UpdateWeightsFromTensorRequest(serialized_named_tensors=["e30="], load_format="flattened_bucket"),
        "UpdateWeightsFromTensorReqInput",
        {"expected_checksum", "activate"},
    ),
    (DestroyWeightsUpdateGroupRequest(), "DestroyWeightsUpdateGroupReqInput", set()),
]

# Every SGLang endpoint the controller calls (``EngineClient``), old and new names.
ENDPOINTS = [
    "/health",
    "/health_generate",
    "/model_info",
    "/get_model_info",
    "/server_info",
    "/get_server_info",
    "/update_weights_from_disk",
    "/init_weights_update_group",
    "/update_weights_from_distributed",
    "/update_weights_from_tensor",
    "/destroy_weights_update_group",
    "/update_weight_version",
    "/pause_generation",
    "/continue_generation",
    "/abort_request",
    "/flush_cache",
    "/weights_checker",
]


def body(request: BaseModel) -> dict[str, Any]:
    return request.model_dump(mode="json")


@pytest.fixture(scope="module")
def sglang() -> dict[str, Any]:
    """SGLang's answers to every question this module asks, from one run of its code."""
    if not (REF / "sglang").is_dir() or not (DEPS / "msgspec").is_dir():
        pytest.fail(f"SGLang's source ({REF}) or msgspec ({DEPS}) is missing: run `make test` (or `make sglang-ref`)")
    argvs = [
        SGLangLaunchCommand("m", 8, args, extra_args=extra).server_args(s, Path("/ckpt/0"))
        for args, extra, s, _ in LAUNCHES
    ]
    argvs.append(["--model-path", "/ckpt/0", "--tensor-parallel-size-typo", "2"])
    questions: dict[str, Any] = {"argvs": argvs, "requests": [[cls, body(req)] for req, cls, _ in REQUESTS]}
    questions["flags_of"] = list(MILES_FLAGS)
    questions["requests"].append(["PauseGenerationReqInput", body(PauseGenerationRequest(mode=PauseMode.DRAIN))])
    done = subprocess.run(
        [sys.executable, str(HERE / "sglang_reference.py")],
        input=json.dumps(questions),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("index", range(len(LAUNCHES)))
def test_sglangs_parser_reads_the_launch_command_as_meant(sglang: dict[str, Any], index: int) -> None:
    answer = sglang["argvs"][index]
    assert "error" not in answer, answer
    parsed = answer["args"]
    expected = {"model_path": "/ckpt/0", "host": "10.0.0.5", "served_model_name": "m", "max_running_requests": 8}
    expected |= LAUNCHES[index][3]
    assert {k: parsed[k] for k in expected} == expected


def test_a_flag_sglang_does_not_have_is_refused_by_its_parser(sglang: dict[str, Any]) -> None:
    assert "unrecognized arguments: --tensor-parallel-size-typo" in sglang["argvs"][-1]["error"]


@pytest.mark.parametrize("index", range(len(REQUESTS)))
def test_sglangs_request_class_reads_what_the_client_sends(sglang: dict[str, Any], index: int) -> None:
    request, cls, extensions = REQUESTS[index]
    answer = sglang["requests"][index]
    assert answer["error"] is None, f"{cls}: {answer['error']}"
    # Anything SGLang's class lacks must be a miles extension SGLang ignores (its HTTP server
    # drops unknown fields); a field SGLang renamed shows up here.
    assert set(answer["unknown"]) <= extensions, f"{cls} has no field(s) {answer['unknown']}"


def test_drain_is_not_an_sglang_pause_mode(sglang: dict[str, Any]) -> None:
    """Why SGLangRollout does not send it to SGLang servers (its updates drain by themselves)."""
    assert "Invalid enum value 'drain'" in sglang["requests"][-1]["error"]


def test_every_endpoint_the_client_calls_is_an_sglang_route() -> None:
    source = (REF / "sglang/srt/entrypoints/http_server.py").read_text(encoding="utf-8")
    routes = set(re.findall(r'@app\.(?:get|post|put|api_route)\(\s*"([^"]+)"', source))
    assert [e for e in ENDPOINTS if e not in routes] == []


def test_launch_command_runs_sglang_under_the_parent_watch() -> None:
    argv = SGLangLaunchCommand("m", 8, SGLangServerArgs()).argv(slot(gpu_ids=(2,)), Path("/ckpt/0"))
    assert argv[:5] == [sys.executable, "-m", "miles.rollout.with_parent", "--", sys.executable]
    assert argv[5:7] == ["-m", "sglang.launch_server"]
    assert argv[argv.index("--base-gpu-id") + 1] == "2"


def test_every_spelling_of_a_flag_miles_sets_is_known(sglang: dict[str, Any]) -> None:
    """SGLang's parser names every option that sets what miles sets: all must be refused in
    engine_args (an alias SGLang adds shows up here)."""
    assert {dest: sorted(flags) for dest, flags in sglang["flags"].items()} == {
        dest: sorted(flags) for dest, flags in MILES_FLAGS.items()
    }


@pytest.mark.parametrize("arg", ["--port", "--port=31000", "--tensor-parallel-size", "--model", "--base-gpu-id=3"])
def test_engine_args_may_not_repeat_what_miles_sets(arg: str) -> None:
    with pytest.raises(RolloutError, match=f"engine_args sets {arg.split('=')[0]}"):
        check_engine_args(("--chunked-prefill-size", "8192", arg, "1"))


def test_engine_args_pass_everything_else() -> None:
    check_engine_args(("--chunked-prefill-size", "8192", "--attention-backend", "triton", "--portable"))
