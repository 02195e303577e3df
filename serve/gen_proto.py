"""Regenerate the checked-in gRPC code from serve/proto/jaxinfer/v1/inference.proto.

    python -m serve.gen_proto            # rewrite serve/proto/jaxinfer/v1/*_pb2*.py{,i}
    python -m serve.gen_proto OUT_DIR    # write OUT_DIR/jaxinfer/v1/... instead

protoc writes `from jaxinfer.v1 import inference_pb2` into the service module,
which would resolve to this repository's `jaxinfer` package; the import is
rewritten to a relative one so the code works from `serve.proto.jaxinfer.v1`.
tests/test_serve_proto.py fails when the checked-in files are stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).parent / "proto"
PROTO_FILE = "jaxinfer/v1/inference.proto"
GENERATED = ("inference_pb2.py", "inference_pb2.pyi", "inference_pb2_grpc.py")
_ABSOLUTE_IMPORT = "from jaxinfer.v1 import inference_pb2 as"
_RELATIVE_IMPORT = "from . import inference_pb2 as"


def generate(out_root: Path) -> list[Path]:
    """Run protoc into `out_root`; returns the generated files."""
    from grpc_tools import protoc  # a build-time tool: import only when regenerating

    out_root.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"  # google/protobuf/*.proto
    status = protoc.main([
        "grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{include}",
        f"--python_out={out_root}", f"--pyi_out={out_root}", f"--grpc_python_out={out_root}",
        str(PROTO_ROOT / PROTO_FILE),
    ])
    if status != 0:
        raise RuntimeError(f"protoc failed with status {status} on {PROTO_FILE}")
    folder = out_root / Path(PROTO_FILE).parent
    _relative_import(folder / "inference_pb2_grpc.py")
    return [folder / name for name in GENERATED]


def _relative_import(path: Path) -> None:
    text = path.read_text()
    if _ABSOLUTE_IMPORT not in text:
        raise RuntimeError(f"{path.name}: expected {_ABSOLUTE_IMPORT!r} from protoc")
    path.write_text(text.replace(_ABSOLUTE_IMPORT, _RELATIVE_IMPORT))


def main(argv: list[str]) -> int:
    out_root = Path(argv[0]) if argv else PROTO_ROOT
    for path in generate(out_root):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
