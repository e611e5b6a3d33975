"""One request's failure inside a step never costs the other requests their generations.

The real Scheduler drives a real tiny model in-process. The fault is forced by a scriptable runner
(the real runner, subclassed) that raises whenever a poisoned token id reaches the model: in a
prompt or history it prefills, or among the tokens it decodes. Every other request must finish
normally with exactly the tokens it produces alone; the poisoned one ends with ``abort``, its
partial output, and a message saying generation failed inside the engine.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from miles.engine.fused_decoder import FusedDecoderRunner
from miles.engine.model_runner import TransformersRunner, load_model
from miles.engine.sampling import RowSampler
from miles.engine.scheduler import Scheduler
from miles.engine.sequence import Sequence
from miles.engine.weights.lock import WeightsLock
from miles.protocol.sglang import GenerateResponse, SamplingParams

CPU = torch.device("cpu")
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
A, B, C = [10, 20, 30], [40, 50], [33, 44, 55, 66]


class _Poisoned:
    """Mixin for a real runner: any prefill or decode that feeds ``poison`` to the model raises."""

    poison: int | None = None

    def prefill(self, prompts: list[list[int]]) -> tuple[object, torch.Tensor]:
        if self.poison is not None and any(self.poison in prompt for prompt in prompts):
            raise RuntimeError(f"poisoned token {self.poison} in a prefill")
        return super().prefill(prompts)  # type: ignore[misc]

    def decode(self, batch: object, tokens: list[int]) -> torch.Tensor:
        if self.poison is not None and self.poison in tokens:
            raise RuntimeError(f"poisoned token {self.poison} in a decode")
        return super().decode(batch, tokens)  # type: ignore[misc]


class PoisonedFused(_Poisoned, FusedDecoderRunner):
    pass


class PoisonedTransformers(_Poisoned, TransformersRunner):
    pass


class _Sink:
    def __init__(self) -> None:
        self._done = threading.Event()
        self._response: GenerateResponse | None = None

    def progress(self, snapshot: GenerateResponse) -> None:
        pass

    def finish(self, response: GenerateResponse) -> None:
        self._response = response
        self._done.set()

    def result(self) -> GenerateResponse:
        assert self._done.wait(60), "the request never finished"
        assert self._response is not None
        return self._response


class _Detokenizer:
    def __init__(self, checkpoint: Path) -> None:
        self._tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))

    def decode(self, ids: list[int], *, skip_special_tokens: bool) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(params=[PoisonedFused, PoisonedTransformers], ids=["fused", "transformers"])
def runner_cls(request: pytest.FixtureRequest) -> type[_Poisoned]:
    return request.param


def generate(
    checkpoint: Path,
    runner_cls: type,
    requests: dict[str, tuple[list[int], SamplingParams]],
    *,
    poison: int | None,
    detokenizer: _Detokenizer | None = None,
) -> dict[str, GenerateResponse]:
    """Run ``requests`` (rid -> prompt, settings) through one scheduler, admitted as one group."""
    model = load_model(checkpoint, device=CPU)

    def setup() -> _Poisoned:
        runner = runner_cls(model, device=CPU, pad_token_id=0)
        runner.poison = poison
        return runner

    scheduler = Scheduler(
        setup=setup,
        detokenizer=detokenizer or _Detokenizer(checkpoint),
        weights_lock=WeightsLock(),
        weight_version=lambda: "1",
        max_running_requests=16,
    )
    sinks = {rid: _Sink() for rid in requests}
    # Queued before the thread starts, so the first step admits (and prefills) them all together.
    for rid, (prompt, params) in requests.items():
        sampler = RowSampler.create(params, eos_ids=frozenset())
        scheduler.submit(Sequence(rid=rid, prompt_ids=prompt, sampler=sampler, sink=sinks[rid]))
    scheduler.start(timeout=60)
    try:
        return {rid: sink.result() for rid, sink in sinks.items()}
    finally:
        scheduler.stop()


def alone(checkpoint: Path, runner_cls: type, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    return generate(checkpoint, runner_cls, {"r": (prompt, params)}, poison=None)["r"].output_ids


def assert_failed_alone(response: GenerateResponse) -> None:
    meta = response.meta_info
    assert meta.finish_reason is not None and meta.finish_reason.type == "abort"
    assert meta.interrupted is True
    assert "generation failed inside the engine for this request" in (meta.finish_reason.message or "")


def assert_finished_as_alone(response: GenerateResponse, expected: list[int]) -> None:
    meta = response.meta_info
    assert meta.finish_reason is not None and meta.finish_reason.type == "length", meta.finish_reason
    assert meta.interrupted is False
    assert response.output_ids == expected


def assert_logged_with_traceback(caplog: pytest.LogCaptureFixture, rid: str) -> None:
    failures = [r for r in caplog.records if r.getMessage().startswith(f"generation failed for request {rid}")]
    assert failures and all(r.exc_info for r in failures), "each failure is logged with its traceback"


def test_a_prompt_that_breaks_the_group_prefill_fails_alone(
    checkpoints: dict[str, Path], runner_cls: type, caplog: pytest.LogCaptureFixture
) -> None:
    checkpoint = checkpoints["v1"]
    expected = {"a": alone(checkpoint, runner_cls, A), "b": alone(checkpoint, runner_cls, B)}
    used = set(A + B + expected["a"] + expected["b"])
    poison = next(t for t in range(3, 250) if t not in used)
    caplog.set_level(logging.WARNING, logger="miles.engine")
    results = generate(
        checkpoint,
        runner_cls,
        {"a": (A, GREEDY), "bad": ([7, poison, 9], GREEDY), "b": (B, GREEDY)},
        poison=poison,
    )
    assert_finished_as_alone(results["a"], expected["a"])
    assert_finished_as_alone(results["b"], expected["b"])
    assert_failed_alone(results["bad"])
    assert results["bad"].output_ids == []
    assert_logged_with_traceback(caplog, "bad")


def test_settings_that_break_sampling_fail_alone_and_seeded_neighbours_draw_as_alone(
    checkpoints: dict[str, Path], runner_cls: type, caplog: pytest.LogCaptureFixture
) -> None:
    checkpoint = checkpoints["v1"]
    seeded = SamplingParams(max_new_tokens=12, temperature=1.0, sampling_seed=7, ignore_eos=True)
    expected = {"a": alone(checkpoint, runner_cls, A), "c": alone(checkpoint, runner_cls, C, seeded)}
    # What the engine now refuses at the door (an out-of-vocabulary stop id masked by
    # min_new_tokens indexes past the logits), sent straight to the scheduler.
    breaking = SamplingParams(max_new_tokens=12, min_new_tokens=2, stop_token_ids=[10**9], temperature=0.0)
    caplog.set_level(logging.WARNING, logger="miles.engine")
    results = generate(
        checkpoint,
        runner_cls,
        {"a": (A, GREEDY), "bad": (B, breaking), "c": (C, seeded)},
        poison=None,
    )
    assert_finished_as_alone(results["a"], expected["a"])
    assert_finished_as_alone(results["c"], expected["c"])
    assert_failed_alone(results["bad"])
    assert_logged_with_traceback(caplog, "bad")


def test_a_decode_that_fails_rebuilds_the_batch_and_fails_only_its_cause(
    checkpoints: dict[str, Path], runner_cls: type, caplog: pytest.LogCaptureFixture
) -> None:
    checkpoint = checkpoints["v1"]
    expected = {"a": alone(checkpoint, runner_cls, A), "b": alone(checkpoint, runner_cls, B)}
    others = set(A + B + expected["a"] + expected["b"])
    # A prompt whose own greedy output reaches a token no other request ever feeds the model:
    # decoding that token raises, and so does prefilling any history that holds it.
    for prompt in ([61, 62], [70, 71, 72], [80], [90, 91], [100, 101, 102], [110]):
        output = alone(checkpoint, runner_cls, prompt)
        index = next(
            (i for i in range(1, len(output) - 1) if output[i] not in others | set(prompt) | set(output[:i])), None
        )
        if index is not None:
            break
    else:
        pytest.skip("no prompt reaches a token that no other request uses")
    caplog.set_level(logging.WARNING, logger="miles.engine")
    results = generate(
        checkpoint,
        runner_cls,
        {"a": (A, GREEDY), "bad": (prompt, GREEDY), "b": (B, GREEDY)},
        poison=output[index],
    )
    assert_finished_as_alone(results["a"], expected["a"])
    assert_finished_as_alone(results["b"], expected["b"])
    assert_failed_alone(results["bad"])
    # Its output up to and including the token whose decode failed comes back.
    assert results["bad"].output_ids == output[: index + 1]
    assert_logged_with_traceback(caplog, "bad")


class _FailsOnLength(_Detokenizer):
    """A tokenizer that cannot decode an output of ``length`` tokens."""

    def __init__(self, checkpoint: Path, length: int) -> None:
        super().__init__(checkpoint)
        self.length = length

    def decode(self, ids: list[int], *, skip_special_tokens: bool) -> str:
        if len(ids) == self.length:
            raise ValueError(f"cannot decode {len(ids)} tokens")
        return super().decode(ids, skip_special_tokens=skip_special_tokens)


def test_an_output_the_tokenizer_cannot_decode_ends_its_request_alone_without_text(
    checkpoints: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """Answering the request fails at every try (its end, then the failure paths that would end it):
    it is still answered, without its text, and the scheduler thread goes on serving the others."""
    checkpoint = checkpoints["v1"]
    expected = {rid: alone(checkpoint, TransformersRunner, prompt) for rid, prompt in (("a", A), ("b", B))}
    short = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
    caplog.set_level(logging.WARNING, logger="miles.engine")
    results = generate(
        checkpoint,
        TransformersRunner,
        {"a": (A, GREEDY), "bad": (C, short), "b": (B, GREEDY)},
        poison=None,
        detokenizer=_FailsOnLength(checkpoint, 5),
    )
    assert_finished_as_alone(results["a"], expected["a"])
    assert_finished_as_alone(results["b"], expected["b"])
    bad = results["bad"]
    assert bad.meta_info.finish_reason is not None and bad.meta_info.finish_reason.type == "abort"
    assert "could not decode this request's output (ValueError: cannot decode 5 tokens)" in (
        bad.meta_info.finish_reason.message or ""
    )
    assert bad.text == "" and bad.output_ids == alone(checkpoint, TransformersRunner, C, short)
    assert any(r.getMessage().startswith("could not build the answer of request bad") for r in caplog.records)
