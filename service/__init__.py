"""gradserve's HTTP service: the FastAPI app, its wire schemas and codec, the CLI and a client."""
