"""Checks of a machine meshrl is about to run on: `meshrl check gpu` (meshrl/tools/checks/gpu.py) runs the
trainer's GPU paths with what the machine has, and writes every figure it measured."""
