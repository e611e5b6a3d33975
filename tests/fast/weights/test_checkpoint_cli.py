"""``miles checkpoint``: init, verify, checksum and seal on real directories."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from miles.commands.checkpoint import ExitCode, PresetName, app
from miles.models.presets import PRESETS
from miles.weights.checkpoint import MANIFEST_NAME, read_manifest

MakeCheckpoint = Callable[..., tuple[Path, Any]]


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def test_preset_choices_match_the_presets() -> None:
    assert {p.value for p in PresetName} == set(PRESETS)


def test_init_prints_what_it_wrote(runner: CliRunner, tmp_path: Path) -> None:
    out = tmp_path / "ck"
    result = runner.invoke(app, ["init", str(out), "--model-name", "demo", "--seed", "5", "--step", "2"])
    assert result.exit_code == 0, result.output
    manifest = read_manifest(out)
    assert (manifest.model_name, manifest.step) == ("demo", 2)
    lines = result.stdout.splitlines()
    assert f"path: {out}" in lines
    assert "model: demo" in lines and "preset: tiny" in lines
    assert f"params: {PRESETS['tiny'].num_parameters():,}" in lines
    assert f"checksum: {manifest.checksum}" in lines


def test_init_refuses_an_existing_directory_unless_overwrite(runner: CliRunner, tmp_path: Path) -> None:
    out = tmp_path / "ck"
    assert runner.invoke(app, ["init", str(out), "--model-name", "m", "--preset", "tiny-tied"]).exit_code == 0
    first = read_manifest(out).checksum
    again = runner.invoke(app, ["init", str(out), "--model-name", "m", "--seed", "1"])
    assert again.exit_code == ExitCode.NOT_A_CHECKPOINT
    assert "overwrite" in again.output
    replaced = runner.invoke(app, ["init", str(out), "--model-name", "m", "--seed", "1", "--overwrite"])
    assert replaced.exit_code == 0
    assert read_manifest(out).checksum != first


def test_init_rejects_an_unknown_preset(runner: CliRunner, tmp_path: Path) -> None:
    result = runner.invoke(app, ["init", str(tmp_path / "ck"), "--model-name", "m", "--preset", "huge"])
    assert result.exit_code == 2
    assert not (tmp_path / "ck").exists()


def test_verify_ok(runner: CliRunner, make_checkpoint: MakeCheckpoint) -> None:
    directory, manifest = make_checkpoint()
    result = runner.invoke(app, ["verify", str(directory)])
    assert result.exit_code == 0
    assert result.stdout.strip() == f"OK {manifest.checksum}"


def test_verify_lists_problems(
    runner: CliRunner,
    make_checkpoint: MakeCheckpoint,
    tensor_offset: Callable[..., int],
    flip_byte: Callable[..., None],
) -> None:
    directory, _ = make_checkpoint()
    path = directory / "model.safetensors"
    flip_byte(path, tensor_offset(path, "model.norm.weight"))
    result = runner.invoke(app, ["verify", str(directory)])
    assert result.exit_code == ExitCode.PROBLEMS
    assert "digest_mismatch" in result.stdout and "model.norm.weight" in result.stdout


def test_verify_a_directory_without_manifest_says_seal(runner: CliRunner, make_checkpoint: MakeCheckpoint) -> None:
    directory, _ = make_checkpoint()
    (directory / MANIFEST_NAME).unlink()
    result = runner.invoke(app, ["verify", str(directory)])
    assert result.exit_code == ExitCode.PROBLEMS
    assert "missing_manifest" in result.stdout and "seal" in result.stdout


@pytest.mark.parametrize("command", ["verify", "checksum"])
def test_not_a_checkpoint_exits_2(runner: CliRunner, tmp_path: Path, command: str) -> None:
    (tmp_path / "empty").mkdir()
    for target in (tmp_path / "empty", tmp_path / "absent"):
        result = runner.invoke(app, [command, str(target)])
        assert result.exit_code == ExitCode.NOT_A_CHECKPOINT
        assert "not a checkpoint" in result.output


def test_checksum_prints_only_the_checksum(runner: CliRunner, make_checkpoint: MakeCheckpoint) -> None:
    directory, manifest = make_checkpoint(max_shard_size="40KB")
    result = runner.invoke(app, ["checksum", str(directory)])
    assert result.exit_code == 0
    assert result.stdout == f"{manifest.checksum}\n"


def test_checksum_differs_from_manifest(runner: CliRunner, make_checkpoint: MakeCheckpoint) -> None:
    directory, manifest = make_checkpoint()
    data = json.loads((directory / MANIFEST_NAME).read_text())
    data["checksum"] = "f" * 32
    (directory / MANIFEST_NAME).write_text(json.dumps(data))
    result = runner.invoke(app, ["checksum", str(directory)])
    assert result.exit_code == ExitCode.PROBLEMS
    assert result.stdout == f"{manifest.checksum}\n"
    assert "differs from the manifest" in result.stderr


def test_checksum_of_a_truncated_file_fails(runner: CliRunner, make_checkpoint: MakeCheckpoint) -> None:
    directory, _ = make_checkpoint()
    path = directory / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    result = runner.invoke(app, ["checksum", str(directory)])
    assert result.exit_code == ExitCode.PROBLEMS
    assert "ends before" in result.stderr


def test_seal(runner: CliRunner, make_checkpoint: MakeCheckpoint, tmp_path: Path) -> None:
    directory, manifest = make_checkpoint()
    (directory / MANIFEST_NAME).unlink()
    result = runner.invoke(app, ["seal", str(directory), "--model-name", "brought", "--step", "7"])
    assert result.exit_code == 0, result.output
    assert manifest.checksum in result.stdout
    sealed = read_manifest(directory)
    assert (sealed.model_name, sealed.step, sealed.checksum) == ("brought", 7, manifest.checksum)
    assert runner.invoke(app, ["verify", str(directory)]).exit_code == 0
    empty = tmp_path / "empty"
    empty.mkdir()
    refused = runner.invoke(app, ["seal", str(empty), "--model-name", "m", "--step", "0"])
    assert refused.exit_code == ExitCode.NOT_A_CHECKPOINT
