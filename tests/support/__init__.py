"""Test support that is not part of meshrl's wheel: the in-process simulation of a run (fake actors
following the role contracts, and the real controller over them: `simulation`), Monarch's actor handles
faked with Monarch's order of work (`fake_monarch`), and the weight-ring stress driver (`weight_stress`).

The tests import it as `support.*` (pytest puts tests/ on sys.path); the benches that use it
(`meshrl bench controller`, the stress phase of `meshrl bench weight-sync`) find it in a repository
checkout through meshrl/tools/bench/checkout.py, and say so when meshrl runs without one."""
