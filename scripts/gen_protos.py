"""Generate the Python gRPC stubs for protos/ into specd/v1/ (git-ignored)."""
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"


def main() -> None:
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    grpc_include = Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{grpc_include}", f"--python_out={ROOT}",
            f"--grpc_python_out={ROOT}", f"--pyi_out={ROOT}", *protos]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    (ROOT / "specd" / "v1" / "__init__.py").touch()
    print(f"generated stubs for {len(protos)} protos into specd/v1/")


if __name__ == "__main__":
    main()
