"""The SDK installs and works without the server: ``pip install tandem-serving`` (no extra)
brings grpcio, protobuf and googleapis-common-protos, not torch; ``[server]`` brings the rest.

How, with no network: the project's wheel is built from this checkout (``pip wheel --no-deps
--no-build-isolation``) and installed with ``--no-index --no-deps`` into a fresh virtual
environment (no system site-packages). No wheel of its core dependencies is at hand offline,
so they, and what they require in turn, are copied from this environment file for file as
their installer recorded them (each distribution's ``RECORD``, dist-info included): the fresh
environment then holds those distributions and nothing else. ``pip check`` there says
whether they satisfy everything the wheel and they declare; a script run there in isolated
mode, outside the checkout, says whether they are enough for the SDK: it imports it, calls a
real gRPC server (``ListModels``, served in the same script with the generated servicer) and
an unreachable one, and finds torch neither loaded nor installed. A package the SDK imports
but ``dependencies`` lacks fails that script.

Slow-ish (a wheel build and a venv, ~30-60 s); what a client-only user gets depends on it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import venv
from importlib.metadata import Distribution, distribution
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]

CLIENT_SCRIPT = r'''
import sys
from concurrent import futures

import grpc

import tandem
from protos.tandem.v1 import generation_pb2 as pb
from protos.tandem.v1 import generation_pb2_grpc as pb_grpc


class Models(pb_grpc.GenerationServicer):
    def ListModels(self, request, context):
        return pb.ListModelsResponse(object="list", data=[
            pb.Model(id="tiny", object="model", owned_by="tandem", max_model_len=2048)])


server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
pb_grpc.add_GenerationServicer_to_server(Models(), server)
port = server.add_insecure_port("127.0.0.1:0")
server.start()
with tandem.Client(f"127.0.0.1:{port}", timeout=30) as client:
    models = client.models()
server.stop(0)
assert [m.id for m in models] == ["tiny"], models
try:
    with tandem.Client("127.0.0.1:1", timeout=30) as client:
        client.models()
    raise AssertionError("an unreachable target answered")
except tandem.UnavailableError:
    pass
import importlib.util
print("sdk", tandem.__file__)
print("torch loaded", "torch" in sys.modules)
print("torch installed", importlib.util.find_spec("torch") is not None)
'''


def _closure(requirements: list[str]) -> list[Distribution]:
    """The installed distributions ``requirements`` need, with what they need in turn
    (requirements under an extra left out, environment markers evaluated)."""
    found: dict[str, Distribution] = {}
    pending = [Requirement(text) for text in requirements]
    while pending:
        requirement = pending.pop()
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        key = re.sub(r"[-_.]+", "-", requirement.name).lower()
        if key in found:
            continue
        found[key] = distribution(requirement.name)
        pending += [Requirement(text) for text in found[key].requires or ()]
    return list(found.values())


def _copy_installed(dist: Distribution, site_packages: Path) -> None:
    """``dist``'s files, as its RECORD lists them, into ``site_packages`` (scripts outside
    site-packages and bytecode left out)."""
    for file in dist.files or ():
        if file.parts[0] == ".." or "__pycache__" in file.parts:
            continue
        target = site_packages / file
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(dist.locate_file(file), target)


def _run(*command: str | Path, cwd: Path) -> str:
    result = subprocess.run([str(part) for part in command], cwd=cwd, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, f"{command}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def test_the_sdk_installs_and_runs_without_torch(tmp_path: Path) -> None:
    assert not any(Requirement(r).name == "torch" for r in PROJECT["dependencies"])
    assert any(Requirement(r).name == "torch" for r in PROJECT["optional-dependencies"]["server"])
    wheels = tmp_path / "wheels"
    _run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--wheel-dir", wheels, REPO, cwd=tmp_path)
    wheel = next(wheels.glob("tandem_serving-*.whl"))
    venv.EnvBuilder(with_pip=True, system_site_packages=False).create(tmp_path / "venv")
    python = tmp_path / "venv" / "bin" / "python"
    _run(python, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", wheel,
         cwd=tmp_path)
    site_packages = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))",
                              cwd=tmp_path).strip())
    copied = _closure(PROJECT["dependencies"])
    assert {d.metadata["Name"].lower() for d in copied} >= {
        "grpcio", "protobuf", "googleapis-common-protos"}
    for dist in copied:
        _copy_installed(dist, site_packages)
    _run(python, "-m", "pip", "check", cwd=tmp_path)  # the wheel's declared needs are met
    script = tmp_path / "client_only.py"
    script.write_text(CLIENT_SCRIPT)
    out = _run(python, "-I", script, cwd=tmp_path)
    assert f"sdk {site_packages}/tandem/__init__.py" in out, out
    assert "torch loaded False" in out and "torch installed False" in out, out


def test_the_project_s_own_installs_take_the_server_extra() -> None:
    makefile = (REPO / "Makefile").read_text()
    assert "-e '.[server,dev]'" in makefile
    containerfile = (REPO / "Containerfile").read_text()
    assert '["optional-dependencies"]["server"]' in containerfile
