"""Fuzzing both HTTP APIs from their own OpenAPI schemas (schemathesis + hypothesis).

Every operation of the controller and of an engine gets a bounded number of generated requests,
valid and invalid by its schema; none may answer 5xx. The engine's inference operations are also
sent to the controller, which routes them. Afterwards the fleet must still serve exactly what it
served before. Engines run with a 64-token context so that generated lengths stay cheap.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from miles.ray.rollout.inference_controller import InferenceController
from miles.testing import running_engine

EXAMPLES = 40
CONTEXT = ("--context-length", "64")
GREEDY = {"text": "hello", "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


def fuzz(
    schema: dict[str, Any],
    base_url: str,
    *,
    after: Callable[[Any, requests.Response], None],
    before: Callable[[Any], None] = lambda case: None,
) -> list[str]:
    """Send every operation of ``schema`` generated requests; return the ones that answered 5xx."""
    failures: list[str] = []
    loaded = schemathesis.openapi.from_dict(schema)
    session = requests.Session()
    session.trust_env = False
    for path, methods in schema["paths"].items():
        for method in methods:
            label = f"{method.upper()} {path}"
            operation = loaded[path][method.upper()]
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

                @SETTINGS
                @given(case=operation.as_strategy(generation_mode=mode))
                def run(case: Any) -> None:
                    before(case)
                    response = case.call(base_url=base_url, session=session, timeout=60)
                    if response.status_code >= 500:
                        failures.append(
                            # run() is called at once below, in this iteration: label and mode are current.
                            f"{label} {mode.value}: {response.status_code} {response.text[:300]} <- {case.body!r:.300}"  # noqa: B023
                        )
                    after(case, response)

                try:
                    run()
                except Unsatisfiable:
                    pass  # nothing to make invalid: the operation takes no input (GET /health ...)
    return failures


@pytest.fixture(scope="module")
def controller(checkpoints: dict[str, Path]) -> Iterator[InferenceController]:
    spec = {"tiny": {"checkpoint": checkpoints["v1"], "num_servers": 2, "num_threads": 1, "engine_args": CONTEXT}}
    with InferenceController(spec, port=0, health_interval_s=0.2) as ctl:
        yield ctl


@pytest.fixture(scope="module")
def engine(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    logs = tmp_path_factory.mktemp("fuzz-engine")
    with running_engine(
        checkpoints["v1"], log_dir=logs, extra_args=(*CONTEXT, "--snapshot-dir", str(logs / "snapshots"))
    ) as url:
        yield url


def test_the_engine_answers_no_generated_request_with_a_5xx(engine: str) -> None:
    reference = httpx.post(f"{engine}/generate", json=GREEDY, trust_env=False).json()["output_ids"]
    schema = httpx.get(f"{engine}/openapi.json", trust_env=False).json()

    def after(case: Any, response: requests.Response) -> None:
        # Undo what a valid call changed, so later calls find an engine that generates.
        if case.path == "/pause_generation" and response.status_code == 200:
            httpx.post(f"{engine}/continue_generation", json={}, trust_env=False)

    failures = fuzz(schema, engine, after=after)
    assert not failures, "\n".join(failures[:10])
    httpx.post(f"{engine}/continue_generation", json={}, trust_env=False)
    answer = httpx.post(f"{engine}/generate", json=GREEDY, trust_env=False, timeout=30).json()
    assert answer["output_ids"] == reference


def test_the_controller_answers_no_generated_request_with_a_5xx(controller: InferenceController, engine: str) -> None:
    url = controller.url
    assert url is not None
    reference = httpx.post(f"{url}/generate", json=GREEDY, trust_env=False).json()["output_ids"]
    original = httpx.get(f"{url}/config", trust_env=False).json()
    runtime = {k: v for k, v in original["settings"].items() if k in original["runtime_changeable"]}

    def after(case: Any, response: requests.Response) -> None:
        if response.status_code != 200:
            return
        if case.path == "/update_weights/start":
            httpx.post(f"{url}/update_weights/abort", json={"token": response.json()["token"]}, trust_env=False)
        elif case.path == "/config" and case.method == "PATCH":
            httpx.patch(f"{url}/config", json=runtime, trust_env=False)

    failures = fuzz(httpx.get(f"{url}/openapi.json", trust_env=False).json(), url, after=after)
    # The engine's schema describes the inference bodies the controller routes.
    engine_schema = httpx.get(f"{engine}/openapi.json", trust_env=False).json()
    routed = {"/generate", "/v1/completions", "/v1/chat/completions"}
    engine_schema["paths"] = {p: ops for p, ops in engine_schema["paths"].items() if p in routed}

    def before(case: Any) -> None:
        # A minimum weight version the fleet does not have yet makes a request wait for it, by
        # design, until the request timeout (test_bad_input covers how such waits end).
        if isinstance(case.body, dict):
            case.body.pop("min_weight_version", None)

    failures += fuzz(engine_schema, url, after=after, before=before)
    assert not failures, "\n".join(failures[:10])
    health = controller.health()
    assert health.ok and health.status == "ok" and not health.lock.held
    assert httpx.post(f"{url}/generate", json=GREEDY, trust_env=False, timeout=30).json()["output_ids"] == reference
