"""``tandem render envoy`` (``deploy.render``): the bootstrap it writes, checked by the YAML
parser's events and by the real Envoy binary (``envoy --mode validate``).

The rendered routes and filters themselves are ``test_envoy_config``'s; here: what the
command line writes (no YAML anchors or aliases) and that it takes the flags
``deploy.envoy_runner`` takes, with the same effect.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.envoy_runner import find_envoy
from deploy.local_ca import make_suite_certificates
from deploy.render import main as render_main

pytestmark = pytest.mark.timeout(120)


def _yaml_anchors(text: str) -> list[str]:
    """Anchors and aliases in a YAML text, from the parser's events."""
    return [f"{type(event).__name__} {event.anchor}" for event in yaml.parse(text)
            if getattr(event, "anchor", None) is not None]


def _envoy_validates(path: Path) -> None:
    result = subprocess.run(
        [str(find_envoy()), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def _render(tmp_path: Path, name: str, *args: str) -> tuple[str, dict[str, Any]]:
    out = tmp_path / f"{name}.yaml"
    assert render_main(["envoy", *args, "-o", str(out)]) == 0
    text = out.read_text()
    return text, yaml.safe_load(text)


@pytest.fixture(scope="module")
def suite_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_suite_certificates(tmp_path_factory.mktemp("suite"))


def test_the_written_bootstrap_holds_no_yaml_anchors(tmp_path: Path, suite_dir: Path) -> None:
    """The HTTPS listener shares the HTTP one's routes and filters (the same dicts): a plain
    PyYAML dump writes them once with ``&id001`` and again as ``*id001``."""
    keys = tmp_path / "keys"
    keys.write_text("key-one\n")
    tls = ["--tls-cert", str(suite_dir / "tls.crt"), "--tls-key", str(suite_dir / "tls.key"),
           "--api-key-file", str(keys)]
    for name, target in (("gateway", ["--upstream", "127.0.0.1:50051"]),
                         ("picker", ["--picker", "127.0.0.1:9002"])):
        text, config = _render(tmp_path, name, *target, *tls)
        assert _yaml_anchors(text) == [], name
        assert len(config["static_resources"]["listeners"]) == 2  # HTTP and HTTPS: shared dicts
        _envoy_validates(tmp_path / f"{name}.yaml")
    assert _yaml_anchors("a: &x {b: 1}\nc: *x\n") == ["MappingStartEvent x", "AliasEvent x"]
