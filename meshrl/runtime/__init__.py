"""The runtime: what turns a config into a running job and keeps its record. Hosts and jobs
(`jobs`, `certs`, `gpu_plan`), the actors' processes started and checked (`launch`), one run wired
together and stopped cleanly (`run`), and the metrics it writes (`metric_rows`, `loggers`, `plot`).
It builds the core (meshrl/controller.py and its rules); the core never imports it."""
