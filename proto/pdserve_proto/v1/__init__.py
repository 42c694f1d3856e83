"""Stubs generated from generation.proto by `python proto/generate.py`; do not edit them."""
