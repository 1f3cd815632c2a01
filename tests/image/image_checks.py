"""``make image-test``: the image ``make image`` builds runs what ``tandem render k8s`` tells it
to, the way the pods run it.

Not collected by ``make test`` (the file name is not ``test_*.py``: building the image takes
many minutes); ``make image-test`` builds the image on a local mmdebstrap base and runs this
file, which needs root (it mounts the image and makes namespaces) and podman.

Each check mounts the image's root filesystem (``podman image mount``) and runs a rendered
container's command in ``pod_sandbox.sh``: read-only root, the pod's emptyDirs as empty
tmpfs, the pod's numeric user, its own network namespace with a pod IP from the
benchmarking range, and the environment the image and the manifest give it (the kubelet's
part, ``$(POD_IP)`` and ``$(POD_NAME)`` in args, done here). The checks:

- the image runs as the manifests' non-root user, carries the default model converted, and
  ``tandem serve --help`` (and the picker's, the LoRA syncer's) runs in it;
- the rendered ``both`` replica starts and serves a greedy completion equal, token for
  token, to Hugging Face ``transformers`` on the model in the image; /metrics answers;
- the rendered prefill replica listens for KV pulls on the port the manifest declares;
- the Envoy pod's init container writes the keyed bootstrap as Envoy's user.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from deploy.k8s import (
    DEFAULT_IMAGE,
    IMAGE_DEFAULT_MODEL,
    REPLICA_KV_PORT,
    REPLICA_METRICS_PORT,
    REPLICA_PORT,
    K8sOptions,
    render_k8s_manifests,
)
from engine_common.model.packed_linear import bf16_packing_supported
from tests.hf_reference import hf_greedy

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SANDBOX = HERE / "pod_sandbox.sh"
IMAGE = os.environ.get("TANDEM_IMAGE", DEFAULT_IMAGE)
MAX_TOKENS = 12
# What the kubelet gives OMP_NUM_THREADS from requests.cpu, scaled to this machine.
THREADS = "1"

pytestmark = pytest.mark.timeout(900)


@dataclass(frozen=True)
class Pod:
    """A command running in ``pod_sandbox.sh``, its output in ``log``."""

    process: subprocess.Popen[bytes]
    log: Path


@dataclass(frozen=True)
class Image:
    root: Path
    env: dict[str, str]
    user: str


@pytest.fixture(scope="module")
def image() -> Iterator[Image]:
    if os.geteuid() != 0:
        pytest.fail("make image-test needs root: it mounts the image and makes namespaces")
    inspect = subprocess.run(["podman", "image", "inspect", IMAGE], capture_output=True,
                             text=True, timeout=60)
    if inspect.returncode != 0:
        pytest.fail(f"no image {IMAGE}: run `make image` first ({inspect.stderr.strip()})")
    config = json.loads(inspect.stdout)[0]["Config"]
    root = subprocess.run(["podman", "image", "mount", IMAGE], check=True, capture_output=True,
                          text=True, timeout=120).stdout.strip()
    try:
        env = dict(entry.split("=", 1) for entry in config.get("Env", []))
        yield Image(Path(root), env, config.get("User", ""))
    finally:
        subprocess.run(["podman", "image", "unmount", IMAGE], capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def manifests() -> dict[str, dict[str, Any]]:
    """The default render, plus a ``both`` replica and API keys, by Deployment name."""
    objects = render_k8s_manifests(K8sOptions(both=1, api_key_secret="keys"))
    return {o["metadata"]["name"]: o["spec"]["template"]["spec"] for o in objects
            if o["kind"] == "Deployment"}


def _container_env(image: Image, container: dict[str, Any], pod_ip: str,
                   pod_name: str) -> dict[str, str]:
    """The image's environment, then the manifest's, with the downward API filled in."""
    env = dict(image.env)
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = entry["value"]
            continue
        source = entry["valueFrom"]
        if "resourceFieldRef" in source:
            env[entry["name"]] = THREADS
        else:
            field = source["fieldRef"]["fieldPath"]
            env[entry["name"]] = {"status.podIP": pod_ip, "metadata.name": pod_name}[field]
    return env


def _expand(args: list[str], env: dict[str, str]) -> list[str]:
    """What the kubelet does to $(VAR) in command and args."""
    for name, value in env.items():
        args = [arg.replace(f"$({name})", value) for arg in args]
    return args


def _pod_user(pod: dict[str, Any]) -> str:
    context = pod["securityContext"]
    return f"{context['runAsUser']}:{context['runAsGroup']}"


def _sandbox(image: Image, pod: dict[str, Any], container: dict[str, Any], pod_ip: str,
             tmp_path: Path, argv: list[str] | None = None,
             binds: str = "") -> Pod:
    env = _container_env(image, container, pod_ip, f"{container['name']}-0")
    env_file = tmp_path / f"{container['name']}-{pod_ip}.env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    volumes = {v["name"]: v for v in pod["volumes"]}
    empty_dirs = [m["mountPath"] for m in container["volumeMounts"]
                  if "emptyDir" in volumes[m["name"]] and m["mountPath"] != "/dev/shm"]
    command = argv if argv is not None else _expand(
        [*container["command"], *container.get("args", [])], env)
    log = tmp_path / f"{container['name']}-{pod_ip}.log"
    with open(log, "wb") as output:
        process = subprocess.Popen(
            [str(SANDBOX), str(image.root), pod_ip, _pod_user(pod), ",".join(empty_dirs),
             str(env_file), "--", *command], stdout=output, stderr=subprocess.STDOUT,
            env={**os.environ, "POD_SANDBOX_BINDS": binds})
    return Pod(process, log)


def _in_netns(pod: Pod, *args: str, timeout: float = 400) -> Any:
    """Run ``pod_client.py`` in the sandbox's network namespace; its JSON answer. Fails at
    once, with the pod's log, if the pod's command exits meanwhile."""
    process = pod.process
    own = os.readlink("/proc/self/ns/net")
    deadline = time.monotonic() + 30
    while os.readlink(f"/proc/{process.pid}/ns/net") == own:  # unshare not there yet
        assert time.monotonic() < deadline and process.poll() is None, "no sandbox"
        time.sleep(0.05)
    client = subprocess.Popen(
        ["nsenter", f"--net=/proc/{process.pid}/ns/net", sys.executable,
         str(HERE / "pod_client.py"), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    deadline = time.monotonic() + timeout
    while client.poll() is None:
        if process.poll() is not None or time.monotonic() > deadline:
            client.kill()
            client.wait()
            log = pod.log.read_text(errors="replace")
            pytest.fail(f"the pod's command exited ({process.returncode}) or the client "
                        f"timed out; the pod's log ends:\n{log[-3000:]}")
        time.sleep(0.5)
    stdout, stderr = client.communicate()
    assert client.returncode == 0, stderr[-3000:]
    return json.loads(stdout.strip().splitlines()[-1])


def _stop(pod: Pod) -> None:
    process = pod.process
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)  # unshare: its children are killed with it
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)


def _run(image: Image, pod: dict[str, Any], container: dict[str, Any], argv: list[str],
         tmp_path: Path, binds: str = "") -> str:
    sandbox = _sandbox(image, pod, container, "198.18.0.5", tmp_path, argv, binds)
    try:
        rc = sandbox.process.wait(timeout=300)
    finally:
        _stop(sandbox)
    output = sandbox.log.read_text(errors="replace")
    assert rc == 0, output[-3000:]
    return output


def test_the_image_runs_as_the_manifests_user_with_the_default_model_converted(
        image: Image, manifests: dict[str, dict[str, Any]]) -> None:
    for name, pod in manifests.items():
        if name != "tandem-envoy":
            assert image.user == _pod_user(pod)
    model = image.root / IMAGE_DEFAULT_MODEL.lstrip("/")
    assert (model / "config.json").is_file() and (model / "model.safetensors").is_file()
    assert json.loads((model / "config.json").read_text())["dtype"] == "bfloat16"


def test_the_cli_runs_in_the_image_on_a_read_only_root(
        image: Image, manifests: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    pod = manifests["tandem-decode"]
    (container,) = pod["containers"]
    assert "--kv-host" in _run(image, pod, container, ["tandem", "serve", "--help"], tmp_path)
    assert "--dns" in _run(image, pod, container, ["tandem", "picker", "--help"], tmp_path)
    written = _run(image, pod, container, ["sh", "-c", "touch /opt/tandem/x 2>&1; id -u"],
                   tmp_path)
    assert "Read-only file system" in written and "10001" in written


def test_the_rendered_replica_serves_hf_greedy_text_from_the_image(
        image: Image, manifests: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    """The ``both`` replica, started with the manifest's exact command, and the prefill
    replica beside it (its own namespace): the first serves a greedy completion equal to
    Hugging Face's on the image's model; the second listens for KV on the declared port."""
    both_pod, prefill_pod = manifests["tandem-both"], manifests["tandem-prefill"]
    both = _sandbox(image, both_pod, both_pod["containers"][0], "198.18.0.10", tmp_path)
    prefill = _sandbox(image, prefill_pod, prefill_pod["containers"][0], "198.18.0.11",
                       tmp_path)
    model = image.root / IMAGE_DEFAULT_MODEL.lstrip("/")
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompt = tokenizer("The capital of France is")["input_ids"]
    try:
        served = _in_netns(both, f"198.18.0.10:{REPLICA_PORT}", "--prompt-ids",
                           ",".join(map(str, prompt)), "--max-tokens", str(MAX_TOKENS),
                           "--metrics", f"198.18.0.10:{REPLICA_METRICS_PORT}")
        kv = _in_netns(prefill, f"198.18.0.11:{REPLICA_PORT}", "--listening",
                       str(REPLICA_KV_PORT))
    finally:
        for sandbox in (both, prefill):
            _stop(sandbox)
    logs = {p.name: p.read_text(errors="replace")[-2000:] for p in tmp_path.glob("*.log")}
    dtype = torch.bfloat16 if bf16_packing_supported() else torch.float32  # the engine's auto
    (expected,) = hf_greedy(model, [prompt], MAX_TOKENS, dtype=dtype)
    assert served["token_ids"] == expected, (served, logs)
    assert served["model"] == "SmolLM2-135M-Instruct"
    assert "vllm:num_requests_running" in served["metrics"]
    # The UCX listener: on the advertised pod IP (or the wildcard), never loopback only.
    assert kv["listening"], logs
    assert set(kv["listening"]) <= {"198.18.0.11", "0.0.0.0"}, kv


def test_the_envoy_pods_init_container_writes_the_keyed_bootstrap_as_envoys_user(
        image: Image, manifests: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    """Its exact command, run in the image as the Envoy pod's user, the ConfigMap (the
    rendered bootstrap) and the Secret (keys) standing in as read-only directories."""
    pod = manifests["tandem-envoy"]
    (init,) = pod["initContainers"]
    objects = render_k8s_manifests(K8sOptions(both=1, api_key_secret="keys"))
    config_map = next(o for o in objects if o["kind"] == "ConfigMap")
    template, keys = tmp_path / "template", tmp_path / "keys"
    template.mkdir()
    keys.mkdir()
    (template / "envoy.yaml").write_text(config_map["data"]["envoy.yaml"])
    (keys / "api-keys").write_text("key-1\nkey-2\n")
    for path in (tmp_path, template, keys, template / "envoy.yaml", keys / "api-keys"):
        path.chmod(0o755 if path.is_dir() else 0o644)  # as the kubelet mounts them
    mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    binds = f"{template}:{mounts['config']} {keys}:{mounts['api-keys']}"
    out = mounts["keyed-config"]
    output = _run(image, pod, init, ["sh", "-c", " ".join(init["command"])
                                     + f" && stat -c '%u %a' {out}/envoy.yaml"
                                     + f" && grep -c key-2 {out}/envoy.yaml"],
                  tmp_path, binds=binds)
    owner, count = output.strip().splitlines()[-2:]
    assert owner == "101 600", output  # Envoy's user, readable by it alone
    assert int(count) >= 1, output


def test_the_sandbox_leaves_nothing_behind() -> None:
    time.sleep(1)
    leftovers = subprocess.run(["pgrep", "-f", str(SANDBOX)], capture_output=True, text=True)
    assert leftovers.stdout.strip() == ""
