"""The wire format, shared by the client and the service: what a body means byte for byte.

- `graph_id`: a graph's id (the BLAKE2b-128 of its canonical JSON) and the header that
  carries it to a balancer;
- `dtypes`: the dtype names a tensor travels under, and their little-endian layout;
- `binary`: binary bodies (the Open Inference Protocol's binary tensor extension), framed
  and read the same way in both directions;
- `numbers`: tensor data as strict JSON (non-finite values as the strings "NaN",
  "Infinity" and "-Infinity");
- `catalog`: an op of the catalog as `GET /ops` lists it.

It imports NumPy, orjson and the engine's dtype table, never the client, the service or
the eager engine: both sides import it, and it imports neither (tests/project/test_import_graph.py).
"""
