"""The tools around a run: the `meshrl` command line (`cli`), benchmarks (`bench/`), studies
(`studies/`, `study`), reports and the chaos monkey. The in-process simulation of a run that
`meshrl bench controller` measures the controller on (fake actors with Monarch's order of work) is test
support, outside the wheel: tests/support/ in a repository checkout (bench/checkout.py finds it).
Nothing below imports from here."""
