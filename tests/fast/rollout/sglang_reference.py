"""Run SGLang's own code on what miles sends it: ``python sglang_reference.py < questions.json``.

SGLang cannot be imported in the test process (its GPU dependencies are not installed, and the
stubs that stand in for them here must not leak into other tests), so this script runs apart:
``.sglang-ref`` (SGLang's source) and ``.sglang-deps`` (msgspec) on its path, the modules SGLang
imports but never uses to parse arguments (psutil, pybase64, triton, zmq, IPython) stubbed; its
request classes are defined from their source in ``io_struct.py``.

It reads ``{"argvs": [[...], ...], "requests": [[class_name, body], ...]}`` and prints, per argv,
the ``ServerArgs`` that SGLang's own parser and ``ServerArgs.from_cli_args`` make of it (or the
parser's error), and per request body the fields SGLang's class does not have and whether the
class reads the rest.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import contextlib
import importlib.abc
import importlib.machinery
import io
import json
import os
import sys
import types
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
REF = Path(os.environ.get("MILES_SGLANG_REF") or REPO / ".sglang-ref")
DEPS = Path(os.environ.get("MILES_SGLANG_DEPS") or REPO / ".sglang-deps")
STUBBED = {"psutil", "pybase64", "triton", "zmq", "IPython"}


class _Record:
    """What a stubbed class stands for: takes any arguments (a subclass may declare fields)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        pass

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        for name, value in kwargs.items():
            setattr(self, name, value)


class _Stub(types.ModuleType):
    """A module, class or value nobody on the parsing path uses: any attribute is another stub."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        stub = _Stub(f"{self.__name__}.{name}")
        stub.__path__ = []
        return stub

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _Stub(f"{self.__name__}()")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (_Record,)


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name.split(".")[0] not in STUBBED:
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _Stub(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def parse_argv(server_args: Any, argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(exit_on_error=False)
    server_args.ServerArgs.add_cli_args(parser)
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            namespace = parser.parse_args(argv)
    except (argparse.ArgumentError, SystemExit) as exc:
        lines = errors.getvalue().strip().splitlines() or [str(exc)]
        return {"error": lines[-1]}
    parsed = server_args.ServerArgs.from_cli_args(namespace)
    fields = ("model_path", "host", "port", "served_model_name", "tp_size", "dp_size", "base_gpu_id")
    fields += ("mem_fraction_static", "context_length", "max_running_requests", "chunked_prefill_size")
    return {"args": {name: getattr(parsed, name) for name in fields}}


def request_classes(names: set[str]) -> dict[str, Any]:
    """SGLang's request classes, defined from their own source in ``io_struct.py`` (which cannot
    be imported here: it pulls in the model zoo): each class, its bases, and the names their
    annotations use."""
    import typing

    import msgspec

    tree = ast.parse((REF / "sglang/srt/managers/io_struct.py").read_text(encoding="utf-8"))
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    wanted: list[str] = []
    elsewhere: set[str] = set()  # names their annotations use that io_struct imports or aliases
    markers: set[str] = set()  # of those, the ones called in ``Annotated[...]`` (validators)

    def need(name: str) -> None:
        node = classes[name]
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in classes and base.id not in wanted:
                need(base.id)
        if name not in wanted:
            wanted.append(name)
        for statement in node.body:
            if isinstance(statement, ast.AnnAssign):
                for sub in ast.walk(statement.annotation):
                    if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name):
                        markers.add(sub.func.id)
                    if isinstance(sub, ast.Name) and sub.id in classes and sub.id not in wanted:
                        need(sub.id)
                    elif isinstance(sub, ast.Name) and sub.id not in classes:
                        elsewhere.add(sub.id)

    for name in names:
        need(name)
    # A module of their own, so msgspec resolves their annotations in it.
    module = types.ModuleType("sglang_io_struct_reference")
    # Types defined outside io_struct (tensors, multimodal data) are taken as Any: the fields
    # miles sends are plain JSON.
    module.__dict__.update({name: Any for name in elsewhere})
    module.__dict__.update({name: _Record for name in markers})
    module.__dict__.update({"msgspec": msgspec, **{n: getattr(typing, n) for n in typing.__all__}})
    module.__dict__.update({n: getattr(builtins, n) for n in dir(builtins) if not n.startswith("_")})
    sys.modules[module.__name__] = module
    source = ast.Module(body=[classes[name] for name in wanted], type_ignores=[])
    exec(compile(source, "sglang/srt/managers/io_struct.py", "exec"), module.__dict__)
    return {name: getattr(module, name) for name in names}


def flags_of(server_args: Any, dests: list[str]) -> dict[str, list[str]]:
    """Every option string of SGLang's parser that sets each of ``dests``."""
    parser = argparse.ArgumentParser()
    server_args.ServerArgs.add_cli_args(parser)
    found: dict[str, list[str]] = {dest: [] for dest in dests}
    for action in parser._actions:
        if action.dest in found:
            found[action.dest] += action.option_strings
    return found


def check_request(classes: dict[str, Any], msgspec: Any, class_name: str, body: dict[str, Any]) -> dict[str, Any]:
    cls = classes[class_name]
    fields = msgspec.structs.fields(cls)
    known = {field.name for field in fields}
    unknown = sorted(set(body) - known)
    # The classes are array-like for SGLang's IPC; its HTTP server reads them from JSON objects
    # by field name (msgspec_struct_pydantic_core_schema). A twin read by name checks the types.
    twin = msgspec.defstruct(
        class_name,
        [
            (
                f.name,
                f.type,
                f.default if f.default is not msgspec.NODEFAULT else msgspec.field(default_factory=f.default_factory),
            )
            if f.default is not msgspec.NODEFAULT or f.default_factory is not msgspec.NODEFAULT
            else (f.name, f.type)
            for f in fields
        ],
        kw_only=True,
    )
    try:
        msgspec.convert({k: v for k, v in body.items() if k in known}, twin)
    except msgspec.ValidationError as exc:
        return {"unknown": unknown, "error": str(exc)}
    return {"unknown": unknown, "error": None}


def main() -> None:
    questions = json.load(sys.stdin)
    sys.path[:0] = [str(DEPS), str(REF)]
    sys.meta_path.append(_StubFinder())
    import msgspec
    import sglang.srt.server_args as server_args

    requests = questions.get("requests", [])
    classes = request_classes({name for name, _ in requests})
    answers = {
        "argvs": [parse_argv(server_args, argv) for argv in questions.get("argvs", [])],
        "requests": [check_request(classes, msgspec, name, body) for name, body in requests],
        "flags": flags_of(server_args, questions.get("flags_of", [])),
    }
    print(json.dumps(answers))


if __name__ == "__main__":
    main()
