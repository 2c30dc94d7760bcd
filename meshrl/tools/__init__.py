"""The tools around a run: the `meshrl` command line (`cli`), benchmarks (`bench/`), studies
(`studies/`, `study`), reports and the chaos monkey; and the in-process simulation of a run (fake
actors with Monarch's order of work: `simulation`, `fake_monarch`) that `meshrl bench controller`
measures the controller on and the controller's tests use. Nothing below imports from here."""
