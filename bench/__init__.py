"""The benchmarks: run each as `python3 -m bench.<name>` from the repository's root.

`bench.workloads` holds what they measure (the objectives, the recurrent cell, the chains,
the hardening mix, the peer script), `bench.harness` how they measure it (timers, the
in-process adapter, process-tree RSS, the raw HTTP client, the table); servers start
through `tests.support.server`, the one launcher the tests use too. `bench.record` runs a
script and keeps its output, with the date and the machine, for the benchmarks page.
"""
