"""Goodput under SLOs, disaggregated against colocated: workloads, a load driver, DistServe's
metrics, the rate/SLO-scale sweeps and their plots. `python -m benchmarks.goodput --help`."""
