"""The controller's gate (protocol step 3) on checkpoints whose weights are well sealed but that no
server could be restarted from (a checkpoint an update loads becomes its servers' restart point),
or that describe another model, and on files the filesystem will not open: each is refused with
what to do, before any server is touched."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from miles.config import ControllerSettings
from miles.controller.gate import CheckpointRejected, vet_checkpoint
from miles.controller.plans import Target
from miles.controller.published import PublishedChecksums
from miles.weights.checkpoint import MANIFEST_NAME

MakeCheckpoint = Callable[..., tuple[Path, object]]


def admit(checkpoint: Path, start: Path | None) -> Target:
    return vet_checkpoint(
        checkpoint,
        model_name="tiny-test",
        settings=ControllerSettings(),
        published=PublishedChecksums(),
        weight_version=None,
        serving_version="1",
        start_checkpoint=start,
    )


def edit_config(directory: Path, change: Callable[[dict[str, object]], None]) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))


def loop(path: Path) -> None:
    path.unlink()
    os.symlink(path, path)


BROKEN: dict[str, tuple[Callable[[Path], None], str]] = {
    "no config": (lambda d: (d / "config.json").unlink(), "has no config.json"),
    "config not JSON": (lambda d: (d / "config.json").write_text("{hidden_size: 64"), "config.json that is not JSON"),
    "config not an object": (lambda d: (d / "config.json").write_text("[64]"), "is not a JSON object"),
    "config a directory": (
        lambda d: ((d / "config.json").unlink(), (d / "config.json").mkdir()),
        "config.json that cannot be read (not a regular file)",
    ),
    "config a FIFO": (lambda d: ((d / "config.json").unlink(), os.mkfifo(d / "config.json")), "not a regular file"),
    "config a symlink loop": (lambda d: loop(d / "config.json"), "Too many levels of symbolic links"),
    "another width": (lambda d: edit_config(d, lambda c: c.update(hidden_size=7)), "hidden_size is 7 there and 64"),
    "another architecture": (
        lambda d: edit_config(d, lambda c: c.update(model_type="gpt2")),
        'model_type is "gpt2" there',
    ),
    "no tokenizer": (
        lambda d: [(d / n).unlink() for n in ("tokenizer.json", "tokenizer_config.json")],
        "has no tokenizer (none of tokenizer.json, tokenizer.model, vocab.json, vocab.txt)",
    ),
    "weights a symlink loop": (
        lambda d: loop(d / "model.safetensors"),
        "model.safetensors is not a valid safetensors file (cannot be opened (Too many levels of symbolic links))",
    ),
    "manifest a symlink loop": (lambda d: loop(d / MANIFEST_NAME), "Too many levels of symbolic links"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_checkpoint_no_server_could_start_from_is_refused_saying_why(
    case: str, make_checkpoint: MakeCheckpoint
) -> None:
    start, _ = make_checkpoint("start", seed=0, step=1)
    new, _ = make_checkpoint("new", seed=1, step=2)
    breaking, says = BROKEN[case]
    breaking(new)
    with pytest.raises(CheckpointRejected) as refused:
        admit(new, start)
    assert says in refused.value.message
    assert str(new) in refused.value.message


def test_settings_that_describe_the_file_not_the_model_may_differ(make_checkpoint: MakeCheckpoint) -> None:
    start, _ = make_checkpoint("start", seed=0, step=1)
    new, manifest = make_checkpoint("new", seed=1, step=2)

    def saved_elsewhere(config: dict[str, object]) -> None:
        config["transformers_version"] = "4.0.0"  # another library version saved it
        config["use_cache"] = not config.get("use_cache", True)
        config.pop("rms_norm_eps")  # left out: the default
        config["a_setting_only_this_one_names"] = 1

    edit_config(new, saved_elsewhere)
    # Saved by another library version: no generation config or chat template file, and the
    # vocabulary in another form.
    for name in ("generation_config.json", "chat_template.jinja", "tokenizer_config.json"):
        (new / name).unlink(missing_ok=True)
    (new / "tokenizer.json").rename(new / "vocab.json")
    admitted = admit(new, start)
    assert admitted.checksum == manifest.checksum  # type: ignore[attr-defined]
    assert admitted.weight_version == "2"


def test_without_the_start_checkpoint_only_the_config_itself_is_checked(
    make_checkpoint: MakeCheckpoint, tmp_path: Path
) -> None:
    new, _ = make_checkpoint("new", seed=1, step=2)
    edit_config(new, lambda c: c.update(hidden_size=7))
    assert admit(new, tmp_path / "deleted").weight_version == "2"
    (new / "config.json").write_text("{")
    with pytest.raises(CheckpointRejected, match="not JSON"):
        admit(new, tmp_path / "deleted")
