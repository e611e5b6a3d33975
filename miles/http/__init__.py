"""HTTP adapters of the controller: its FastAPI app, the server that runs it, the data-path proxy,
authentication and metrics, and the client of its window API a trainer in another process uses
(``windows``). Thin: the logic lives in ``miles.controller``."""
