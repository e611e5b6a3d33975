"""An edge fake: an embedded engine seen through the shape of a real SGLang 0.5.23 server's answers.

``python sglang_shaped_proxy.py --upstream URL --port PORT`` forwards everything to the engine at
URL, except where SGLang 0.5.23 answers otherwise:

- ``/weights_checker`` answers SGLang's fields (``ranks``, ``per_engine_checksum``) and no miles
  payload: the digest is a SHA-256 derived from the weights' canonical checksum, so it follows
  the weights but equals no canonical checksum, as SGLang's own digest does not;
- ``/get_weight_version`` and ``/fence`` do not exist (404);
- ``/pause_generation`` refuses ``drain`` (not an SGLang mode) and answers only status and message.

``GET /_fake/authorizations`` lists every ``Authorization`` header it was sent (to check that
nothing of the controller's credentials reaches a server someone else runs).
``POST /_fake/digest_salt {"salt": "..."}`` makes the digests it reports from then on different
(a server whose load went wrong in a way the engine did not notice), ``""`` restores them.
"""

from __future__ import annotations

import argparse
import hashlib
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse


def build(upstream: str) -> FastAPI:
    app = FastAPI()
    http = httpx.AsyncClient(base_url=upstream, timeout=600, trust_env=False)
    state = {"salt": ""}
    authorizations: set[str] = set()

    @app.middleware("http")
    async def record(request: Request, call_next: Any) -> Response:
        if "authorization" in request.headers:
            authorizations.add(request.headers["authorization"])
        return await call_next(request)

    @app.get("/_fake/authorizations")
    async def seen() -> list[str]:
        return sorted(authorizations)

    async def forward(request: Request) -> httpx.Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}
        return await http.request(request.method, request.url.path, content=await request.body(), headers=headers)

    @app.post("/_fake/digest_salt")
    async def salt(body: dict[str, Any]) -> dict[str, str]:
        state["salt"] = str(body["salt"])
        return state

    @app.api_route("/weights_checker", methods=["GET", "POST"])
    async def weights_checker(request: Request) -> Response:
        answer = await forward(request)
        body = answer.json()
        if answer.status_code != 200 or not body.get("payload"):
            return JSONResponse(body, status_code=answer.status_code)
        per_gpu = hashlib.sha256(f"sglang{state['salt']}:{body['payload']['checksum']}".encode()).hexdigest()
        info = {"role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1, "pp_rank": 0}
        info |= {"pp_size": 1, "rank": 0, "size": 1}
        rank = {"checksums": {}, "per_gpu_checksum": per_gpu, "parallelism_info": [info]}
        engine = hashlib.sha256(per_gpu.encode()).hexdigest()
        return JSONResponse({"success": True, "message": "Success.", "ranks": [rank], "per_engine_checksum": engine})

    @app.api_route("/get_weight_version", methods=["GET"])
    @app.api_route("/fence", methods=["POST"])
    async def missing() -> Response:
        return JSONResponse({"detail": "Not Found"}, status_code=404)

    @app.post("/pause_generation")
    async def pause(request: Request) -> Response:
        body = await request.json()
        if body.get("mode", "abort") not in ("abort", "retract", "in_place"):
            return JSONResponse({"object": "error", "message": f"invalid mode {body.get('mode')!r}"}, status_code=400)
        answer = await forward(request)
        if answer.status_code != 200:
            return Response(answer.content, status_code=answer.status_code, media_type="application/json")
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def everything_else(request: Request) -> Response:
        answer = await forward(request)
        return Response(answer.content, status_code=answer.status_code, media_type=answer.headers.get("content-type"))

    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(build(args.upstream), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
