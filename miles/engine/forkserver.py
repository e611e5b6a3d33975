"""``python -m miles.engine.forkserver``: starts engine processes by forking a warm interpreter.

It imports torch and transformers once, most of an engine's start-up (docs/ENGINE.md). It speaks
JSON lines with the process that started it (``miles.rollout.engine_process``): stdin takes
``{"spawn": ID, "args": [...], "env": {...}, "cwd": DIR, "log": PATH, "launcher": PID}`` (the
arguments of ``python -m miles.engine``, and the process asking); stdout answers ``{"ready": true}``
once the imports are done, ``{"spawned": ID, "pid": PID}`` (or ``{"spawned": ID, "error": ...}``),
and ``{"exited": PID, "code": C}`` when an engine ends (C as ``Popen.returncode``: negative for a
signal). The parent signals its engines itself. When its stdin closes (its parent exited or died)
it kills every engine it started and exits; the engines watch their launcher, not it.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shlex
import signal
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any, TextIO

import setproctitle

from miles.engine.settings import LAUNCHER_PID_ENV
from miles.utils.progress_bars import disable_library_progress_bars


def _write(out: TextIO, message: dict[str, Any]) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


def _run_engine(args: list[str], env: dict[str, str], cwd: str, log: str, *, close: list[int]) -> None:
    """In the forked child: become ``python -m miles.engine ARGS`` writing to ``log``; never returns.
    ``close``: the server's own descriptors (its pipes and selector), which the engine must not hold."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd in close:
            os.close(fd)
        stdin = os.open(os.devnull, os.O_RDONLY)
        output = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(stdin, 0)
        os.dup2(output, 1)
        os.dup2(output, 2)
        os.close(stdin)
        os.close(output)
        sys.stdin = open(0, closefd=False)  # the process's own descriptors, now the engine's
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        # What `ps` shows: the engine's command line, as if it had been started on its own (set
        # before the environment changes: the title may take the original environment's room).
        setproctitle.setproctitle(shlex.join([sys.executable, "-m", "miles.engine", *args]))
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        sys.argv = ["miles.engine", *args]
        from miles.engine.__main__ import cli

        cli(args=args, prog_name="python -m miles.engine")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 (whatever ends the engine is logged, then the child exits)
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(code)


@dataclass
class _Server:
    out: TextIO
    own_fds: list[int]  # the server's own descriptors, which a forked engine closes
    children: set[int] = field(default_factory=set)

    def spawn(self, request: dict[str, Any]) -> None:
        ident = request.get("spawn")
        try:
            args = [str(a) for a in request["args"]]
            env = {str(k): str(v) for k, v in request["env"].items()}
            cwd = str(request["cwd"])
            log = str(request["log"])
            env[LAUNCHER_PID_ENV] = str(int(request["launcher"]))
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            _write(self.out, {"spawned": ident, "error": f"malformed spawn request: {exc!r}"})
            return
        try:
            pid = os.fork()
        except OSError as exc:  # out of processes or memory: this launch fails, the others go on
            _write(self.out, {"spawned": ident, "error": f"fork failed: {exc}"})
            return
        if pid == 0:
            _run_engine(args, env, cwd, log, close=self.own_fds)
        self.children.add(pid)
        _write(self.out, {"spawned": ident, "pid": pid})

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.children.discard(pid)
            _write(self.out, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})

    def kill_all(self) -> None:
        for pid in list(self.children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in list(self.children):
            try:
                _, status = os.waitpid(pid, 0)
            except ChildProcessError:
                continue
            with contextlib.suppress(OSError):  # the parent is gone
                _write(self.out, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})
        self.children.clear()


def main() -> None:
    # The parent decides when engines stop: Ctrl-C in a terminal reaches this process too.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The protocol owns stdin and stdout; nothing else may write to them.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    # CUDA cannot be used in a process forked after it was initialized: asking whether a GPU is
    # there must go through NVML here, and the imports must leave CUDA alone.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    # Before the imports (the libraries read it then): every engine forked from here inherits it.
    disable_library_progress_bars()
    try:
        import torch

        import miles.engine.__main__
        import miles.engine.http_server  # noqa: F401 (imported, with the engine, for the children to inherit)
    except BaseException:  # noqa: BLE001 (the parent is told why, and launches engines the slow way)
        _write(out, {"ready": False, "error": traceback.format_exc()[-2000:]})
        return
    if torch.cuda.is_initialized():
        _write(out, {"ready": False, "error": "CUDA was initialized while importing; forked engines could not use it"})
        return
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the selector through the wakeup fd
    selector = selectors.DefaultSelector()
    selector.register(0, selectors.EVENT_READ, "requests")
    selector.register(wake_read, selectors.EVENT_READ, "children")
    server = _Server(out, own_fds=[out.fileno(), wake_read, wake_write, selector.fileno()])
    _write(out, {"ready": True})
    pending = b""
    try:
        while True:
            for key, _ in selector.select():
                if key.data == "children":
                    os.read(wake_read, 4096)
                    continue
                chunk = os.read(0, 1 << 16)
                if not chunk:
                    return
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    try:
                        request = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(request, dict) and "spawn" in request:
                        server.spawn(request)
            server.reap()
    finally:
        server.kill_all()


if __name__ == "__main__":
    main()
