"""HTTP adapters of the controller: the FastAPI app, request forwarding, and the server runner."""
