"""Benchmarks: `meshrl bench NAME`. Each measures ours against its floor in one run."""
