"""Placement planner: latency models, a discrete-event simulator of both layouts, and DistServe's
placement search made aware of KV transfer and memory. Pure computation: nothing here imports
the serving packages, grpc or ray (tests/planner/test_imports.py checks it)."""
