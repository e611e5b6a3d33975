"""The wire models refuse, at validation and naming the field, what the engine could not serve."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from miles.protocol.base import MAX_SEED, MIN_SEED, sample_seed
from miles.protocol.openai import ChatCompletionRequest, CompletionRequest
from miles.protocol.sglang import GenerateRequest, SamplingParams
from miles.protocol.sglang_weights import (
    InitWeightsUpdateGroupRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_k": False}, "top_k"),
        ({"top_k": 0}, "top_k"),
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"temperature": True}, "temperature"),
        ({"sampling_seed": MAX_SEED + 1}, "sampling_seed"),
        ({"seed": MIN_SEED - 1}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop": "\ud800"}, "stop"),
    ],
)
def test_sampling_params_refuse_what_a_step_could_not_use(params: dict, field: str) -> None:
    with pytest.raises(ValidationError) as caught:
        SamplingParams(**params)
    assert field in {str(e["loc"][0]) for e in caught.value.errors()}


def test_every_seed_in_range_seeds_a_torch_generator_and_derived_seeds_wrap() -> None:
    for seed in (MIN_SEED, -1, 0, MAX_SEED):
        torch.Generator().manual_seed(seed)
    assert sample_seed(5, 3) == 8
    assert sample_seed(MAX_SEED, 1) == 0 and sample_seed(MAX_SEED, 63) == 62
    assert sample_seed(MIN_SEED, 2) == MIN_SEED + 2
    params = SamplingParams(sampling_seed=MAX_SEED, n=4)
    for sample in range(4):
        torch.Generator().manual_seed(params.for_sample(sample).effective_seed)  # never out of range


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"prompt": "x", "top_k": -5}, "top_k"),
        ({"prompt": "x", "stop": ""}, "stop"),
        ({"prompt": "x", "seed": 2**70}, "seed"),
        ({"prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": [1, True]}, "prompt"),
    ],
)
def test_openai_requests_refuse_what_the_native_request_would(body: dict, field: str) -> None:
    with pytest.raises(ValidationError) as caught:
        CompletionRequest(**body)
    assert field in str(caught.value)


def test_valid_openai_requests_always_translate() -> None:
    completion = CompletionRequest(prompt="x", top_k=3, stop=["a"], seed=MAX_SEED, max_tokens=7)
    assert completion.sampling_params().max_new_tokens == 7
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], max_completion_tokens=3)
    assert chat.sampling_params().max_new_tokens == 3


def test_text_with_a_lone_surrogate_is_refused_but_a_pair_is_text() -> None:
    with pytest.raises(ValidationError, match="surrogate"):
        GenerateRequest(text=["ok", "bad \udc80"])
    assert GenerateRequest(text="emoji \U0001f600").text == "emoji \U0001f600"


JOIN = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2, "backend": "gloo"}
PUSH = {"names": ["w"], "dtypes": ["float32"], "shapes": [[2]], "load_format": "flattened_bucket"}


@pytest.mark.parametrize(
    ("model", "body", "field"),
    [
        (InitWeightsUpdateGroupRequest, {**JOIN, "master_address": "127.0.0.1\u0000x"}, "master_address"),
        (InitWeightsUpdateGroupRequest, {**JOIN, "master_address": "::::"}, "master_address"),
        (InitWeightsUpdateGroupRequest, {**JOIN, "master_address": "a host"}, "master_address"),
        (InitWeightsUpdateGroupRequest, {**JOIN, "master_address": "-a.b"}, "master_address"),
        (InitWeightsUpdateGroupRequest, {**JOIN, "rank_offset": "1"}, "rank_offset"),
        (InitWeightsUpdateGroupRequest, {**JOIN, "world_size": True}, "world_size"),
        (InitWeightsUpdateGroupRequest, {**JOIN, "master_port": 29500.0}, "master_port"),
        (UpdateWeightsFromDistributedRequest, {**PUSH, "digests": []}, None),
        (UpdateWeightsFromDistributedRequest, {**PUSH, "flush_cache": "yes"}, "flush_cache"),
        (UpdateWeightsFromDistributedRequest, {**PUSH, "abort_all_requests": 1}, "abort_all_requests"),
        (UpdateWeightsFromTensorRequest, {"serialized_named_tensors": ["x"], "activate": "false"}, "activate"),
    ],
)
def test_weight_push_requests_take_their_own_types_only(model: type, body: dict, field: str | None) -> None:
    """A text, a float or a boolean is no port, rank or flag; an empty digest list is not 'no digests'."""
    with pytest.raises(ValidationError) as caught:
        model.model_validate(body)
    if field is not None:
        assert field in {str(e["loc"][0]) for e in caught.value.errors()}


def test_a_join_names_its_rank_0_by_address_or_host_name() -> None:
    for address in ("127.0.0.1", "::1", "localhost", "trainer-0.cluster.local", "10.0.0.7"):
        assert InitWeightsUpdateGroupRequest.model_validate({**JOIN, "master_address": address})
