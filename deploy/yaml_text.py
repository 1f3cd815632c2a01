"""YAML text of rendered configuration: block style, key order kept, no anchors or aliases.

Owns one rule: a rendered object that holds the same dict twice (a Deployment's labels are
its selector's and its pod template's) is written out twice, never as ``&id001`` / ``*id001``,
which some tools (and readers) do not follow, and which ``kubectl`` would expand anyway. It
does not own what is rendered.
"""

from __future__ import annotations

from typing import Any

import yaml


class _NoAliasDumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump_yaml(obj: Any) -> str:
    return yaml.dump(obj, Dumper=_NoAliasDumper, sort_keys=False, width=100)
