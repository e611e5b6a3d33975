"""Test helper: ``EngineDiskApply``, an ``ApplyFn`` that loads a checkpoint straight into engine processes.

For tests of the trainer without a controller: every engine is told to
``/update_weights_from_disk``, then asked for ``/weights_checker``, and the checksum it computes
over the weights it holds must equal the manifest's. There is no lock and no rollback here (that
is the controller's job): on failure the call raises and the engines are left as they ended up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import httpx

from miles.errors import ChecksumMismatchError, PublishError
from miles.protocol.sglang_weights import UpdateWeightsFromDiskRequest
from miles.rollout.engine_client import EngineClient
from miles.weights.checkpoint import Manifest


class EngineDiskApply:
    """Load and verify a checkpoint on every engine at ``urls`` (concurrently)."""

    def __init__(self, urls: Sequence[str], *, http: httpx.AsyncClient, timeout_s: float = 120.0) -> None:
        """``http`` is owned by the caller.

        Raises:
            ValueError: no URL given.
        """
        if not urls:
            raise ValueError("give at least one engine base URL")
        self._clients = tuple(EngineClient(url, http=http, server_id=url) for url in urls)
        self._timeout_s = timeout_s

    async def __call__(self, checkpoint_dir: Path, manifest: Manifest) -> None:
        """Return once every engine serves ``manifest.weight_version`` with the manifest's checksum.

        Raises:
            PublishError: an engine refused the checkpoint.
            ChecksumMismatchError: an engine holds weights with another checksum after loading.
            EngineCallError: an engine could not be reached or answered an error.
        """
        await asyncio.gather(*(self._one(client, checkpoint_dir, manifest) for client in self._clients))

    async def _one(self, client: EngineClient, checkpoint_dir: Path, manifest: Manifest) -> None:
        request = UpdateWeightsFromDiskRequest(model_path=str(checkpoint_dir), weight_version=manifest.weight_version)
        result = await client.update_weights_from_disk(request, timeout=self._timeout_s)
        if not result.success:
            raise PublishError(
                f"engine refused the checkpoint: {result.message}",
                server_id=client.server_id,
                step=manifest.step,
                version=manifest.weight_version,
            )
        # Ask again rather than trust the update's answer: this is the checksum the engine computes
        # now over what it holds, the value the protocol admits a server on.
        held = await client.weights_checksum(timeout=self._timeout_s)
        if held.checksum != manifest.checksum or held.weight_version != manifest.weight_version:
            raise ChecksumMismatchError(
                "engine holds other weights than the checkpoint it was told to load",
                server_id=client.server_id,
                expected=manifest.checksum,
                actual=held.checksum,
                expected_version=manifest.weight_version,
                actual_version=held.weight_version,
            )
