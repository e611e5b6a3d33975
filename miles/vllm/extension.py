"""miles' worker extension for vLLM: verified loads, and the checksum of what a worker holds.

Loaded into every worker (``--worker-extension-cls miles.vllm.extension.MilesWorkerExtension``)
and called through vLLM's ``POST /collective_rpc`` (``miles.rollout.vllm_client``); each method
answers a JSON object. docs/VLLM.md says what each call does. Importing this module registers
miles' weight-transfer backend (``miles.vllm.transfer``). It runs in vLLM's worker processes and
imports torch and ``miles.weights`` only.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from miles.errors import CheckpointError, ManifestMissingError, MilesError
from miles.vllm.held import held_state
from miles.vllm.transfer import MilesTransferEngine, end_reload, register
from miles.weights.checksum import checksum_state_dict
from miles.weights.manifest import Manifest, manifest_from_files, read_manifest, write_manifest
from miles.weights.reader import open_checkpoint

register()

# What a checksum of this worker covers, as the confirmation says.
HASHED = "the tensors the vLLM worker holds, read back from its layers under the checkpoint's names"


class MilesWorkerExtension:
    """Mixed into vLLM's worker class (``self`` is the worker: ``reload_weights``, ``model_runner``)."""

    _miles_checksum: str | None = None

    def miles_identity(self) -> dict[str, Any]:
        return {"checksum": self._miles_checksum, "instance_id": _instance_id()}

    def miles_checksum(self) -> dict[str, Any]:
        started = time.perf_counter()
        state = self._miles_held()
        checksum = checksum_state_dict(state)
        self._miles_checksum = checksum.checksum
        return {
            "checksum": checksum.checksum,
            "algorithm": checksum.algorithm,
            "tensors": len(state),
            "num_bytes": checksum.num_bytes,
            "hashed": HASHED,
            "seconds": time.perf_counter() - started,
        }

    def miles_load(self, path: str, expected_checksum: str) -> dict[str, Any]:
        started = time.perf_counter()
        try:
            tensors, checkpoint_checksum = _read_expected(Path(path), expected_checksum)
        except (MilesError, OSError) as exc:
            message = exc.message if isinstance(exc, MilesError) else f"the checkpoint could not be read: {exc}"
            return {"success": False, "changed": False, "message": message, "checkpoint_checksum": None}
        loaded = time.perf_counter()
        self._miles_checksum = None  # whatever happens now, the last checksum no longer holds
        failure: str | None = None
        try:
            self._miles_end_reload()
            self.reload_weights(weights_iterator=iter(tensors.items()))  # type: ignore[attr-defined]
        except Exception as exc:  # noqa: BLE001  # vLLM's reload raises anything; the checksum below tells
            failure = f"vLLM's reload failed midway ({type(exc).__name__}: {exc}); the worker holds other weights"
        copied = time.perf_counter()
        confirmed = self.miles_checksum()
        return {
            "success": True,
            "changed": True,
            "message": failure or "loaded",
            "checksum": confirmed["checksum"],
            "checkpoint_checksum": checkpoint_checksum,
            "hashed": HASHED,
            "timings": {"verify": loaded - started, "copy": copied - loaded, "checksum": confirmed["seconds"]},
        }

    def miles_end_push(self) -> dict[str, Any]:
        ended = self._miles_end_reload()
        engine = getattr(self, "weight_transfer_engine", None)
        left = engine.leave() if isinstance(engine, MilesTransferEngine) else None
        return {"ended": ended, "left": left}

    def _miles_end_reload(self) -> bool:
        """End a push's reload left open (its session, or a reload vLLM forgot); False when none was."""
        if getattr(self, "_weight_update_active", False):
            self.finish_weight_update()  # type: ignore[attr-defined]
            return True
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return end_reload(model, self.vllm_config.model_config)  # type: ignore[attr-defined]

    def miles_export(self, step: str) -> dict[str, Any]:
        state = self._miles_held()
        checksum = checksum_state_dict(state).checksum
        config = self.vllm_config.model_config  # type: ignore[attr-defined]
        root = Path(os.environ["MILES_SNAPSHOT_DIR"])
        target = root / f"vllm-{int(step)}-{checksum[:16]}"
        if not (target / "miles_manifest.json").is_file():
            root.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{target.name}.tmp-"))
            try:
                save_file({name: t.clone() for name, t in state.items()}, tmp / "model.safetensors")
                source = Path(config.model)
                for extra in source.iterdir():  # config, tokenizer: everything but the weights
                    if extra.is_file() and not extra.name.endswith(".safetensors") and extra.suffix != ".bin":
                        if extra.name not in ("miles_manifest.json", "model.safetensors.index.json"):
                            shutil.copy2(extra, tmp / extra.name)
                manifest = manifest_from_files(tmp, model_name=source.name, step=int(step))
                if manifest.checksum != checksum:
                    raise CheckpointError(f"the written weights hash to {manifest.checksum}, not {checksum}")
                write_manifest(tmp, manifest)
                shutil.rmtree(target, ignore_errors=True)
                tmp.rename(target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return {"path": str(target), "checksum": checksum}

    def _miles_held(self) -> dict[str, torch.Tensor]:
        self._miles_end_reload()
        config = self.vllm_config.model_config  # type: ignore[attr-defined]
        tied = bool(getattr(config.hf_config, "tie_word_embeddings", False))
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return held_state(model, dtype=config.dtype, tied_embeddings=tied)


def _read_expected(path: Path, expected_checksum: str) -> tuple[dict[str, torch.Tensor], str]:
    """The checkpoint's tensors, read once and hashed as read; CheckpointError unless they are
    the weights ``expected_checksum`` names (a sealed checkpoint's problems are named one by one)."""
    try:
        manifest: Manifest = read_manifest(path)
        sealed = True
    except ManifestMissingError:
        manifest = manifest_from_files(path, model_name=path.name, step=0)
        sealed = False
    if manifest.checksum != expected_checksum:
        where = "its manifest names" if sealed else "its files hash to"
        raise CheckpointError(
            f"the checkpoint at {path} is not the one expected: {where} {manifest.checksum}, expected "
            f"{expected_checksum}; load the checkpoint the update publishes"
        )
    with open_checkpoint(path, manifest=manifest) as reader:
        tensors = {name: reader.tensor(name) for name in reader.tensor_names}
        read = checksum_state_dict(tensors).checksum
        if read != expected_checksum:
            if sealed:
                reader.verify().raise_for_problems(limit=5)
            raise CheckpointError(
                f"the checkpoint at {path} changed while it was read (its tensors hash to {read}, expected "
                f"{expected_checksum}); write checkpoints to a new directory and publish it once complete"
            )
    return tensors, read


def _instance_id() -> str:
    """This worker process: its pid and when it started (a restarted worker answers another)."""
    started = Path(f"/proc/{os.getpid()}/stat").read_text(encoding="ascii").rsplit(")", 1)[1].split()[19]
    return f"vllm-worker:{os.getpid()}:{started}"
