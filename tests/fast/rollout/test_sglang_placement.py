"""SGLang servers on Ray: the GPUs each one asks for and the GPUs it says it uses, from tables."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from miles.config import RuntimeKind
from miles.rollout.rollout import RolloutError
from miles.rollout.runtime import sglang_gpu_ids
from miles.rollout.sglang_rollout import SGLangRollout, check_ray_gpus
from miles.rollout.spec import RolloutSpec, SGLangServerArgs


@pytest.mark.parametrize(
    ("info", "expected"),
    [
        ({"device": "cpu", "gpu_ids": []}, ()),  # the embedded engine lists its own
        ({"device": "cuda", "gpu_ids": [3]}, (3,)),
        ({"device": "cuda", "base_gpu_id": 4, "tp_size": 2, "dp_size": 1}, (4, 5)),  # SGLang
        ({"device": "cuda", "base_gpu_id": 0, "tp_size": 2, "dp_size": 2, "gpu_id_step": 2}, (0, 2, 4, 6)),
        ({"device": "cpu", "base_gpu_id": 0, "tp_size": 1, "dp_size": 1}, None),
    ],
)
def test_the_gpus_an_engine_reports(info: dict[str, Any], expected: tuple[int, ...] | None) -> None:
    assert sglang_gpu_ids(info) == expected


@pytest.mark.parametrize(
    ("tp", "dp", "gpus", "ok"),
    [
        (1, 1, 1.0, True),
        (1, 1, 0.5, True),
        (2, 1, 2.0, True),
        (2, 2, 4.0, True),
        (2, 1, 1.0, False),
        (1, 1, 0.0, False),
    ],
)
def test_each_server_on_ray_asks_for_the_gpus_sglang_will_use(tp: int, dp: int, gpus: float, ok: bool) -> None:
    spec = RolloutSpec(
        checkpoint=Path("/nonexistent"),
        runtime=RuntimeKind.RAY,
        num_gpus_per_engine=gpus,
        devices=("cuda:0",),
        sglang=SGLangServerArgs(tp_size=tp, dp_size=dp),
    )
    if ok:
        check_ray_gpus(spec)
        return
    with pytest.raises(RolloutError, match=f"set num_gpus_per_engine={tp * dp}"):
        check_ray_gpus(spec)
    with pytest.raises(RolloutError, match=f"set num_gpus_per_engine={tp * dp}"):
        SGLangRollout(spec)  # refused before anything connects to a cluster
