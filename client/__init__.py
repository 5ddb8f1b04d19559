"""The Python client of gradserve: the HTTP client (`http`: `Client`, `AsyncClient`), the
tracer that writes graphs from Python functions (`trace`), and the op catalog it traces
with (`catalog`). `from gradserve import Client, trace, F` gives their public names.

It speaks the wire format (gradserve.wire) and reads the engine's shape and dtype rules
(gradserve.engine.rules); it never imports the service nor the eager engine
(tests/project/test_import_graph.py), so `pip install gradserve` is a client without a server."""
