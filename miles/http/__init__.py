"""HTTP adapters of the controller: its FastAPI app, the server that runs it, the data-path proxy,
authentication and metrics. Thin: the logic lives in ``miles.controller``."""
