"""Regenerates the Python stubs from the .proto files: `python -m proto.generate`.

The generator is pinned (GRPC_TOOLS_VERSION): stubs embed the grpcio version
that made them and refuse to import on an older grpcio, so the pin is the
oldest grpcio we support.
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata, resources
from pathlib import Path

GRPC_TOOLS_VERSION = "1.84.0"
ROOT = Path(__file__).resolve().parent.parent
PROTOS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "proto").rglob("*.proto"))


def generate(out_dir: Path) -> None:
    try:
        found = metadata.version("grpcio-tools")
    except metadata.PackageNotFoundError:
        sys.exit(f"grpcio-tools=={GRPC_TOOLS_VERSION} is needed: pip install grpcio-tools=={GRPC_TOOLS_VERSION}")
    if found != GRPC_TOOLS_VERSION:
        sys.exit(f"grpcio-tools {found} found; the stubs are pinned to {GRPC_TOOLS_VERSION}: pip install grpcio-tools=={GRPC_TOOLS_VERSION}")
    from grpc_tools import protoc

    well_known = str(resources.files("grpc_tools") / "_proto")
    out_dir.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{ROOT}", f"-I{well_known}", f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *PROTOS]
    if protoc.main(args) != 0:
        sys.exit("protoc failed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT, help="root to write the stubs under (default: the repo)")
    generate(parser.parse_args().out)


if __name__ == "__main__":
    main()
