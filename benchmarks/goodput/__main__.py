"""`python -m benchmarks.goodput --compare --out DIR [--quick]`."""

from benchmarks.goodput.compare import main

if __name__ == "__main__":
    raise SystemExit(main())
