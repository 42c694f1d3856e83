"""`python -m benchmarks.profiling --out PROFILE.json [--quick]`, the same as `pdserve profile`."""

from benchmarks.profiling.cli import main

if __name__ == "__main__":
    raise SystemExit(main(prog="python -m benchmarks.profiling"))
