"""Running the pods `tandem render k8s` writes, as plain processes, the way a kubelet would.

Reads the rendered Deployments and turns one pod's first container into a command line and
an environment: the container's ``command`` and ``args`` with ``$(VAR)`` expanded from its
``env`` (the downward API's ``POD_NAME`` and ``POD_IP`` filled with the pod's name and
address, a resource field with its request), every volume mount pointed at a local directory
(an ``emptyDir`` made empty, a ``configMap`` written out from the rendered ConfigMap, a
``secret`` or a ``persistentVolumeClaim`` given by the test by name) and the image's programs
(``tandem``, ``envoy``) found here. Paths under a mount, in arguments and environment values,
name the local directory instead, as the container would see the volume there.
Nothing is rewritten beyond what a kubelet substitutes, so the test runs exactly what the
manifests say.
"""

from __future__ import annotations

import re
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from deploy.envoy_runner import find_envoy

# Mounts a local process needs no stand-in for.
_SKIPPED_MOUNTS = frozenset({"/dev/shm"})
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


@dataclass(frozen=True)
class PodCommand:
    argv: list[str]
    env: dict[str, str]


def read_manifests(directory: Path) -> list[dict[str, Any]]:
    return [doc for path in sorted(directory.glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    for obj in objects:
        if obj["kind"] == kind and obj["metadata"]["name"] == name:
            return obj
    raise LookupError(f"no {kind} named {name} among the rendered objects")


def _programs() -> dict[str, str]:
    return {"tandem": str(Path(sys.executable).with_name("tandem")),
            "envoy": str(find_envoy())}


def pod_command(deployment: dict[str, Any], objects: list[dict[str, Any]], *, pod_name: str,
                pod_ip: str, workdir: Path, given: Mapping[str, Path]) -> PodCommand:
    """The first container of ``deployment``'s pod as a local command."""
    spec = deployment["spec"]["template"]["spec"]
    container = spec["containers"][0]
    mounts = _mount_volumes(spec, container, objects, workdir, given)
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}
    downward = {"metadata.name": pod_name, "status.podIP": pod_ip}
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = _local(_expand(str(entry["value"]), env), mounts)
        elif "fieldRef" in entry["valueFrom"]:
            env[entry["name"]] = downward[entry["valueFrom"]["fieldRef"]["fieldPath"]]
        elif "resourceFieldRef" in entry["valueFrom"]:
            env[entry["name"]] = "1"  # the test's pods ask for one CPU each
    words = [*container.get("command", []), *container.get("args", [])]
    argv = [_local(_expand(word, env), mounts) for word in words]
    argv[0] = _programs().get(argv[0], argv[0])
    return PodCommand(argv, env)


def _expand(word: str, env: Mapping[str, str]) -> str:
    return _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), word)


def _local(word: str, mounts: Mapping[str, Path]) -> str:
    for mount_path, local in sorted(mounts.items(), key=lambda item: -len(item[0])):
        if word == mount_path or word.startswith(mount_path.rstrip("/") + "/"):
            return str(local) + word[len(mount_path.rstrip("/")):]
    return word


def _mount_volumes(spec: dict[str, Any], container: dict[str, Any],
                   objects: list[dict[str, Any]], workdir: Path,
                   given: Mapping[str, Path]) -> dict[str, Path]:
    """Each mount path -> its local directory. ``given``: secrets and claims by name."""
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    mounts: dict[str, Path] = {}
    files: list[Path] = []  # config files, which may name other mounts' paths
    for mount in container.get("volumeMounts", []):
        if mount["mountPath"] in _SKIPPED_MOUNTS:
            continue
        volume = volumes[mount["name"]]
        local = workdir / mount["name"]
        if "secret" in volume:
            shutil.copytree(given[volume["secret"]["secretName"]], local, dirs_exist_ok=True)
        elif "persistentVolumeClaim" in volume:
            local = given[volume["persistentVolumeClaim"]["claimName"]]
        elif "configMap" in volume:
            config = find(objects, "ConfigMap", volume["configMap"]["name"])
            local.mkdir(parents=True, exist_ok=True)
            for key, text in config["data"].items():
                (local / key).write_text(text)
                files.append(local / key)
        else:
            local.mkdir(parents=True, exist_ok=True)
        mounts[mount["mountPath"]] = local
    # A config file names the paths the container sees (a Secret's mount, say): here those
    # are the local directories.
    mounted = {path: local for path, local in mounts.items()
               if any(m["mountPath"] == path and ("secret" in volumes[m["name"]]
                                                  or "configMap" in volumes[m["name"]])
                      for m in container.get("volumeMounts", []))}
    for file in files:
        text = file.read_text()
        for path, local in sorted(mounted.items(), key=lambda item: -len(item[0])):
            text = text.replace(path.rstrip("/") + "/", f"{local}/")
        file.write_text(text)
    return mounts
