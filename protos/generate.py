"""Regenerates the Python code and Envoy's descriptor set from ``protos/tandem/v1/*.proto``.

Owns the one protoc invocation of the project: ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py``
next to each ``.proto``, and ``protos/tandem.binpb`` (a FileDescriptorSet with its imports and
no source info, which Envoy's grpc_json_transcoder loads). Compiling with ``-I <repo root>``
makes the generated imports read ``from protos.tandem.v1 import ...``, so the modules import
as ``protos.tandem.v1.engine_pb2``. The output is a pure function of the ``.proto`` files and
the pinned grpcio-tools version: running it twice gives identical bytes.

    python -m protos.generate          # rewrite the committed files
    python -m protos.generate --check  # exit 1, naming the stale files, if they are out of date

It does not own the contracts themselves (the ``.proto`` files) nor Envoy's configuration.
"""

from __future__ import annotations

import argparse
import filecmp
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = Path("protos/tandem/v1")  # relative to REPO_ROOT, as protoc names the files
DESCRIPTOR_SET = Path("protos/tandem.binpb")
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


class GenerationError(RuntimeError):
    """protoc (or its prerequisites) failed; the message carries its output."""


def proto_files() -> list[Path]:
    """The ``.proto`` sources, relative to the repo root, in a stable order."""
    return sorted(p.relative_to(REPO_ROOT) for p in (REPO_ROOT / PROTO_DIR).glob("*.proto"))


def include_dirs() -> list[Path]:
    """grpc_tools' copy of google/protobuf/*.proto and googleapis-common-protos' google/api/."""
    tools = importlib.util.find_spec("grpc_tools")
    if tools is None or tools.origin is None:
        raise GenerationError("grpcio-tools is not installed (pip install 'tandem[dev]')")
    well_known = Path(tools.origin).parent / "_proto"
    api = importlib.util.find_spec("google.api.annotations_pb2")
    if api is None or api.origin is None:
        raise GenerationError("googleapis-common-protos is not installed")
    googleapis = Path(api.origin).parent.parent.parent  # .../site-packages (holds google/api/)
    if not (googleapis / "google/api/annotations.proto").is_file():
        raise GenerationError(f"google/api/annotations.proto not found under {googleapis}")
    return [well_known, googleapis]


def generated_files(protos: list[Path]) -> list[Path]:
    """Every file protoc writes for these sources, relative to the output root."""
    outputs = [DESCRIPTOR_SET]
    for proto in protos:
        stem = proto.with_suffix("")
        outputs += [stem.with_name(stem.name + suffix) for suffix in GENERATED_SUFFIXES]
    return sorted(outputs)


def generate(out_root: Path) -> list[Path]:
    """Runs protoc, writing under ``out_root`` (the repo root, or a scratch dir); returns the
    written paths relative to ``out_root``."""
    protos = proto_files()
    if not protos:
        raise GenerationError(f"no .proto files under {REPO_ROOT / PROTO_DIR}")
    (out_root / DESCRIPTOR_SET).parent.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "grpc_tools.protoc",
        "-I.", *(f"-I{d}" for d in include_dirs()),
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"--descriptor_set_out={out_root / DESCRIPTOR_SET}",
        "--include_imports",  # Envoy resolves google.api.http and Struct from the set itself
        *(str(p) for p in protos),
    ]  # fmt: skip
    # cwd is the repo root so that "-I." names the files protos/tandem/v1/x.proto.
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise GenerationError(f"protoc failed ({result.returncode}):\n{result.stderr}")
    outputs = generated_files(protos)
    missing = [str(p) for p in outputs if not (out_root / p).is_file()]
    if missing:
        raise GenerationError(f"protoc did not write {', '.join(missing)}")
    return outputs


def stale_files(fresh_root: Path) -> list[Path]:
    """Committed files that differ from a fresh generation under ``fresh_root``, are missing,
    or are generated leftovers of a ``.proto`` that no longer exists."""
    expected = set(generated_files(proto_files()))
    committed = {DESCRIPTOR_SET} if (REPO_ROOT / DESCRIPTOR_SET).exists() else set()
    for suffix in GENERATED_SUFFIXES:
        committed |= {p.relative_to(REPO_ROOT) for p in (REPO_ROOT / PROTO_DIR).glob("*" + suffix)}
    stale = committed - expected
    for path in expected:
        repo_file = REPO_ROOT / path
        if not repo_file.is_file() or not filecmp.cmp(repo_file, fresh_root / path, shallow=False):
            stale.add(path)
    return sorted(stale)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m protos.generate", description=__doc__)
    parser.add_argument(
        "--check",
        action="store_true",
        help="regenerate into a scratch dir and fail if the committed files differ",
    )
    args = parser.parse_args(argv)
    try:
        if not args.check:
            for path in generate(REPO_ROOT):
                print(f"wrote {path}")
            return 0
        with tempfile.TemporaryDirectory(prefix="tandem-protos-") as scratch:
            generate(Path(scratch))
            stale = stale_files(Path(scratch))
    except GenerationError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if stale:
        listing = "\n".join(f"  {path}" for path in stale)
        print(
            f"generated protobuf code is stale:\n{listing}\n"
            "run `python -m protos.generate` (or `make protos`) and commit the result",
            file=sys.stderr,
        )
        return 1
    print("generated protobuf code is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
