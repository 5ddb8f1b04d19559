"""gradserve's HTTP service: the FastAPI app, its wire schemas and codec, the CLI and a client."""

if __name__ != "gradserve.service":  # the folder imported by its own name, from a checkout
    raise ImportError(
        f"this is gradserve.service: import it by that name, not {__name__!r} "
        "(two names would load every module twice)"
    )
