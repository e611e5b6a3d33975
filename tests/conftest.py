"""Shared fixtures: tiny real checkpoints built from configs, and the environment every test needs."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from blocking.no_blocking import LOG_DIR_ENV, watch

from miles.testing import wait_until

# Nothing in the suite may reach a model hub; fail loudly instead of downloading.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def no_blocking_call_on_an_event_loop(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test during which a blocking call (sleep, file or socket I/O, a contended lock...)
    ran on a running event loop, in this process or in one the suite started (an engine, the
    CLI); ``tests/blocking/no_blocking.py`` says what may block and why."""
    found: list[str] = []
    buster = watch(found.append)
    try:
        yield
    finally:
        buster.deactivate()
    found += _drain(request.config.stash[_BLOCKING_LOG])
    if found:
        pytest.fail(f"{len(found)} blocking call(s) on a running event loop; the first: {found[0]}", pytrace=False)


def _drain(log_dir: Path) -> list[str]:
    """What the processes the suite started found since the last look (and forget it)."""
    found = []
    for log in sorted(p for p in log_dir.iterdir() if p.is_file()):
        found.append(log.read_text())
        log.unlink()
    return found


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Versions of one tiny model (``v1``..``v4``: same architecture, different weights, steps 1-4)
    and ``b1``, step 1 of a second model ``tiny-b``."""
    from miles.models.presets import init_checkpoint

    root = tmp_path_factory.mktemp("checkpoints")
    made = {}
    for name, model, seed, step in (
        ("v1", "tiny", 0, 1),
        ("v2", "tiny", 1, 2),
        ("v3", "tiny", 2, 3),
        ("v4", "tiny", 3, 4),
        ("b1", "tiny-b", 10, 1),
    ):
        init_checkpoint(root / name, model_name=model, preset="tiny", seed=seed, step=step)
        made[name] = root / name
    return made


@pytest.fixture(scope="session")
def small(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path | str]:
    """Checkpoints of the ``small`` preset (vLLM's CPU attention refuses the ``tiny`` preset's head
    size): ``s0`` and ``s1``, sealed (steps 0 and 1); ``plain-a`` and ``plain-b``, what a trainer
    writes with save_pretrained, no manifest (their checksums beside them)."""
    from miles.models import build_model, build_tokenizer
    from miles.models.presets import init_checkpoint
    from miles.weights.checksum import model_checksum

    root = tmp_path_factory.mktemp("small")
    made: dict[str, Path | str] = {}
    for name, seed, step in (("s0", 0, 0), ("s1", 1, 1)):
        init_checkpoint(root / name, model_name="small", preset="small", seed=seed, step=step)
        made[name] = root / name
    for name, seed in (("plain-a", 2), ("plain-b", 3)):
        model = build_model("small", seed=seed)
        model.save_pretrained(root / name)
        build_tokenizer().save_pretrained(root / name)
        made[name], made[f"{name}-checksum"] = root / name, model_checksum(model)
    return made


@pytest.fixture
def supervisor_rounds() -> Callable[..., Awaitable[None]]:
    """``await supervisor_rounds(rollout, n)``: wait until the rollout's supervisor has probed its
    servers ``n`` more times (a negative assertion waits for this, not for a sleep)."""

    async def wait(rollout: Any, count: int = 2) -> None:
        target = rollout.probe_rounds + count
        await wait_until(lambda: rollout.probe_rounds >= target, what=f"{count} rounds of health probes")

    return wait


_BLOCKING_LOG = pytest.StashKey[Path]()

# `make test` runs the suite on two xdist workers, each taking a group of tests at a time: a
# module, so that a module's fixture starts once; the vLLM package (its fleet is package-scoped)
# and the Ray modules (each starts a cluster) as one group each, one test at a time. They are
# the longest groups, and go first, so that neither is what the run waits for at its end.
_FIRST = ("tests/vllm", "tests/ray")


def _group(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return next((first for first in _FIRST if path.startswith(f"{first}/")), path)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    # Not xdist's `loadgroup` marks: with pytest 9 they no longer reach the test ids it reads.
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

    return ByGroup(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "PYTEST_XDIST_WORKER" in os.environ:  # only xdist's workers collect
        order = {first: n for n, first in enumerate(_FIRST)}
        items.sort(key=lambda item: order.get(_group(item.nodeid), len(order)))


def pytest_configure(config: pytest.Config) -> None:
    # save_pretrained draws a progress bar per checkpoint; in test output it is only noise.
    import transformers

    transformers.utils.logging.disable_progress_bar()
    # Every Python process the suite starts imports tests/blocking/sitecustomize.py, which
    # watches it for blocking calls on its event loops and reports them in this directory. An
    # xdist worker reports into a folder of its own inside its controller's, which the
    # controller reads once every worker has finished.
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is not None:
        log_dir = Path(os.environ[LOG_DIR_ENV]) / worker
        log_dir.mkdir()
    else:
        log_dir = Path(tempfile.mkdtemp(prefix="miles-blocking-"))
    config.stash[_BLOCKING_LOG] = log_dir
    os.environ[LOG_DIR_ENV] = str(log_dir)
    if worker is None and config.getoption("dist", "no") != "no":
        return  # the workers would import the hooks too: each adds them for its own processes
    hooks = str(Path(__file__).parent / "blocking")
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if hooks not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (hooks, *paths) if p)


def pytest_sessionfinish(session: pytest.Session) -> None:
    # What a process reported after the last test looked (an engine of a module's fixture, as it
    # stopped) fails the run too: read by the controller, whose exit status is the run's.
    if os.environ.get("PYTEST_XDIST_WORKER") is not None:
        return
    log_dir = session.config.stash[_BLOCKING_LOG]
    folders = [log_dir, *sorted(p for p in log_dir.iterdir() if p.is_dir())]  # one a worker
    late = [text for folder in folders for text in _drain(folder)]
    shutil.rmtree(log_dir, ignore_errors=True)
    if late:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"blocking calls on a running event loop after the last test: {late}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
