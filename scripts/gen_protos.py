#!/usr/bin/env python3
"""Regenerate the checked-in Python stubs of protocol/tasklet.proto with grpcio-tools.

Usage: python scripts/gen_protos.py [--out DIR]   (default: protocol/, next to the .proto)

protoc writes `import tasklet_pb2 as tasklet__pb2` into the gRPC stub, which only works when protocol/ itself
is on sys.path. The stubs live in the `tasklet.protocol` package, so that line is rewritten to a package import.
tests/protocol/test_protocol_stubs.py runs this script into a temporary folder and fails when the checked-in files
differ, so a change to the .proto without regenerating cannot go unnoticed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent.parent / "protocol"
PROTO_NAME = "tasklet.proto"
TOP_LEVEL_IMPORT = "import tasklet_pb2 as tasklet__pb2"
PACKAGE_IMPORT = "from tasklet.protocol import tasklet_pb2 as tasklet__pb2"


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on tasklet.proto into out_dir and fix the stub's import; return the written files."""
    from grpc_tools import protoc  # a dev dependency: imported here so --help works without it

    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(PROTO_DIR / PROTO_NAME),
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit status {rc}")
    grpc_stub = out_dir / "tasklet_pb2_grpc.py"
    text = grpc_stub.read_text()
    if TOP_LEVEL_IMPORT not in text:
        raise RuntimeError(
            f"expected {TOP_LEVEL_IMPORT!r} in the generated {grpc_stub.name}; protoc changed?"
        )
    grpc_stub.write_text(text.replace(TOP_LEVEL_IMPORT, PACKAGE_IMPORT))
    return [out_dir / name for name in ("tasklet_pb2.py", "tasklet_pb2.pyi", "tasklet_pb2_grpc.py")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_DIR, help="output folder (default: protocol/)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
