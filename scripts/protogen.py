"""Regenerate the checked-in protobuf/gRPC code, or check it for drift (``--check``).

protoc names generated imports after the proto's path, so the protos are compiled from a
staging root in which ``kvpool`` points at the repository: the generated gRPC module then
imports ``kvpool.protos.kvpool.v1.master_pb2`` and needs no rewriting.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_DIR = REPO / "protos" / "kvpool" / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out_root: Path) -> list[Path]:
    """Compile every proto under protos/kvpool/v1 into ``out_root``; return generated paths."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as stage:
        os.symlink(REPO, Path(stage) / "kvpool")
        protos = sorted(f"kvpool/protos/kvpool/v1/{p.name}" for p in PROTO_DIR.glob("*.proto"))
        include = str(Path(protoc.__file__).parent / "_proto")
        args = ["protoc", f"-I{stage}", f"-I{include}", f"--python_out={out_root}",
                f"--pyi_out={out_root}", f"--grpc_python_out={out_root}", *protos]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
    return sorted((out_root / "kvpool" / "protos" / "kvpool" / "v1").glob("*_pb2*"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true",
                        help="fail (exit 1) if the checked-in generated code differs from a fresh run")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as out:
        fresh = {p.name: p for p in generate(Path(out))}
        current = {p.name for p in PROTO_DIR.iterdir() if p.name.endswith(GENERATED_SUFFIXES)}
        if args.check:
            drift = sorted(set(fresh) ^ current) + sorted(
                n for n in set(fresh) & current if not filecmp.cmp(fresh[n], PROTO_DIR / n, shallow=False))
            if drift:
                print("generated code is out of date: " + ", ".join(drift)
                      + "\nrun: python scripts/protogen.py", file=sys.stderr)
                return 1
            print(f"generated code up to date ({len(fresh)} files)")
            return 0
        for name in current - set(fresh):
            (PROTO_DIR / name).unlink()
        for name, path in fresh.items():
            shutil.copyfile(path, PROTO_DIR / name)
        print(f"wrote {len(fresh)} files to {PROTO_DIR.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
