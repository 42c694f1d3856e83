"""Regenerate the Python stubs of pdserve's API from its .proto files.

    python proto/generate.py            # rewrite the checked-in stubs beside the .proto files
    python proto/generate.py --out DIR  # write them under DIR instead (the freshness test does)

The .proto files sit under proto/pdserve_proto/, and protoc runs with proto/ as its include
root, so the import path of each file ("pdserve_proto/v1/generation.proto") is also the Python
module path of its stubs: the generated `_pb2_grpc` modules import `pdserve_proto.v1...` as is,
with no rewriting. Needs grpcio-tools (a dev dependency).
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PACKAGE = "pdserve_proto"


def proto_files() -> list[Path]:
    """Every .proto file of the API, relative to PROTO_ROOT, in a stable order."""
    return sorted(p.relative_to(PROTO_ROOT) for p in (PROTO_ROOT / PACKAGE).rglob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on every .proto file; returns the stub paths written under `out_dir`."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = resources.files("grpc_tools") / "_proto"
    sources = [str(p) for p in proto_files()]
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *sources,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {sources}")
    written = []
    for source in proto_files():
        stem = out_dir / source.with_suffix("")
        written += [Path(f"{stem}_pb2.py"), Path(f"{stem}_pb2.pyi"), Path(f"{stem}_pb2_grpc.py")]
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_ROOT, help="root to write stubs under")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
