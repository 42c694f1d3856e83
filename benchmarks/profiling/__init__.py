"""`pdserve profile`: measure a machine's engine steps, KV channel and serving path, so the
planner (planner/fit.py) can fit its latency model."""
