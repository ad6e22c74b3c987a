"""Generate the Python gRPC stubs for protos/ into specd/v1/ (git-ignored).

The one place that runs protoc: `make protos` runs this file, and setup.py's build hook calls
`generate_stubs` whenever setuptools builds the package (a wheel, an sdist's wheel, an editable install).
"""
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent


def generate_stubs() -> int:
    """Write specd/v1/*_pb2*.py(i) for every .proto under protos/; return how many protos."""
    proto_root = ROOT / "protos"
    protos = sorted(str(p.relative_to(proto_root)) for p in proto_root.rglob("*.proto"))
    grpc_include = Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{proto_root}", f"-I{grpc_include}", f"--python_out={ROOT}",
            f"--grpc_python_out={ROOT}", f"--pyi_out={ROOT}", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    (ROOT / "specd" / "v1" / "__init__.py").touch()
    return len(protos)


def main() -> None:
    print(f"generated stubs for {generate_stubs()} protos into specd/v1/")


if __name__ == "__main__":
    main()
