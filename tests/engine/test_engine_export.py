"""POST /export_weights: the weights an engine holds, written as a sealed checkpoint a peer can load."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from miles.testing import running_engine, weights_held
from miles.weights.checkpoint import read_manifest, verify_checkpoint

GREEDY = {"input_ids": [3, 30, 60], "sampling_params": {"max_new_tokens": 12, "temperature": 0}}


@pytest.fixture(scope="module")
def snapshot_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("snapshots")


@pytest.fixture(scope="module")
def engine_url(
    checkpoints: dict[str, Path], snapshot_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    with running_engine(
        checkpoints["v1"],
        log_dir=tmp_path_factory.mktemp("logs"),
        extra_args=("--snapshot-dir", str(snapshot_dir)),
        env={"MILES_ALLOWED_CHECKPOINT_ROOTS": f"{checkpoints['v1'].parent},{snapshot_dir}"},
    ) as url:
        yield url


@pytest.fixture
def http(engine_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=engine_url, timeout=120, trust_env=False) as client:
        yield client


def load(http: httpx.Client, path: Path | str) -> dict:
    response = http.post("/update_weights_from_disk", json={"model_path": str(path)})
    assert response.status_code == 200, response.text
    return response.json()


def test_export_writes_the_held_weights_and_another_engine_loads_them(
    http: httpx.Client, checkpoints: dict[str, Path], snapshot_dir: Path, tmp_path: Path
) -> None:
    v2 = read_manifest(checkpoints["v2"])
    load(http, checkpoints["v2"])
    v2_output = http.post("/generate", json=GREEDY).json()["output_ids"]

    response = http.post("/export_weights", json={"step": 7})
    assert response.status_code == 200, response.text
    exported = response.json()
    path = Path(exported["path"])
    assert exported == {"success": True, "path": str(path), "checksum": v2.checksum, "weight_version": "2"}
    assert path == snapshot_dir / f"tiny-2-{v2.checksum[:16]}"
    manifest = read_manifest(path)
    assert (manifest.checksum, manifest.model_name, manifest.step, manifest.weight_version) == (
        v2.checksum,
        "tiny",
        7,
        "2",
    )
    assert verify_checkpoint(path).ok

    # The same weights again: the sealed snapshot is reused, not rewritten.
    written = (path / "miles_manifest.json").stat().st_mtime_ns
    again = http.post("/export_weights", json={"step": 8}).json()
    assert again["path"] == str(path)
    assert (path / "miles_manifest.json").stat().st_mtime_ns == written

    # An engine holding other weights loads the export and holds exactly what was exported.
    load(http, checkpoints["v1"])
    loaded = load(http, path)
    assert loaded["checksum"] == v2.checksum
    assert weights_held(http) == {"weight_version": "2", "checksum": v2.checksum}
    assert http.post("/generate", json=GREEDY).json()["output_ids"] == v2_output

    # A restarted peer starts from it directly.
    with running_engine(path, log_dir=tmp_path) as peer:
        with httpx.Client(base_url=peer, trust_env=False) as peer_http:
            assert weights_held(peer_http) == {"weight_version": "2", "checksum": v2.checksum}
        output = httpx.post(f"{peer}/generate", json=GREEDY, trust_env=False, timeout=60).json()["output_ids"]
        assert output == v2_output


def test_export_after_a_rename_names_the_snapshot_after_the_new_version(
    http: httpx.Client, checkpoints: dict[str, Path], snapshot_dir: Path
) -> None:
    load(http, checkpoints["v3"])
    assert http.post("/update_weight_version", json={"new_version": "step/3 rc"}).json()["success"] is True
    exported = http.post("/export_weights", json={"step": 3}).json()
    checksum = read_manifest(checkpoints["v3"]).checksum
    # Characters that cannot be part of one directory name are replaced.
    assert exported["path"] == str(snapshot_dir / f"tiny-step_3_rc-{checksum[:16]}")
    assert read_manifest(Path(exported["path"])).weight_version == "step/3 rc"
    assert exported["checksum"] == checksum


@pytest.mark.parametrize(("body", "needle"), [({}, "step"), ({"step": -1}, "step"), ({"step": 1, "x": 1}, "'x'")])
def test_export_takes_a_strict_body(http: httpx.Client, body: dict, needle: str) -> None:
    response = http.post("/export_weights", json=body)
    assert response.status_code == 400
    assert needle in response.json()["error"]["message"]
