"""Keeping the LoRA adapters a server serves in step with a file (``tandem lora sync``): the
sidecar that rolls adapters out in Kubernetes, as the inference extension's LoRA syncer does
for vLLM.

Owns reading the wanted adapters, in the inference extension's ConfigMap format::

    vLLMLoRAConfig:
      ensureExist:
        models:
        - id: sql                     # the name requests give as their model
          source: /models/adapters/sql  # a PEFT adapter directory the server can read
      ensureNotExist:
        models:
        - id: poet

and bringing a server to it through the public API (``Client.models``, ``load_lora_adapter``,
``unload_lora_adapter``): it unloads what must not be there, loads what is missing, and
reloads a name whose source changed. Running (``LoraSyncer.run``), it does so again whenever
the file changes and every interval, which also gives a restarted server (it forgot its
runtime adapters) its adapters back. Sources are directories: nothing is downloaded. A
refusal that retrying cannot fix (a bad directory, a server without
``--allow-runtime-lora-updating``) is logged once and retried only when the file changes.
It does not own loading adapters (the replicas) or spreading a load over a suite (the gateway
does that when it is the target).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import yaml

from tandem.client import Client
from tandem.errors import InvalidRequestError, TandemError

CONFIG_KEY = "vLLMLoRAConfig"
# Keys of the inference extension's format that only its own sidecar reads (which port and
# base model to call): Tandem's takes its server from --target.
_IGNORED_KEYS = frozenset({"name", "port", "defaultBaseModel"})
# Besides InvalidRequestError's (a bad name or directory): a server that loads no adapters.
_PERMANENT_CODES = frozenset({grpc.StatusCode.FAILED_PRECONDITION})

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WantedAdapters:
    present: dict[str, str]  # name -> source directory
    absent: frozenset[str]


@dataclass
class SyncOutcome:
    loaded: list[str] = field(default_factory=list)
    unloaded: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # name -> why

    @property
    def changed(self) -> bool:
        return bool(self.loaded or self.unloaded or self.failed)


def _models(section: Any, where: str) -> list[Mapping[str, Any]]:
    if section is None:
        return []
    if not isinstance(section, Mapping) or set(section) - {"models"}:
        raise ValueError(f"{where} must be a mapping with one key, models")
    models = section.get("models") or []
    if not isinstance(models, list) or not all(isinstance(m, Mapping) for m in models):
        raise ValueError(f"{where}.models must be a list of mappings with id and source")
    return models


def _adapter_id(model: Mapping[str, Any], where: str) -> str:
    name = model.get("id")
    if not isinstance(name, str) or not name:
        raise ValueError(f"every entry of {where}.models needs an id (the adapter's name), "
                         f"got {dict(model)}")
    return name


def parse_wanted_adapters(text: str) -> WantedAdapters:
    """The adapters a config file asks for; ValueError saying what is wrong with it."""
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ValueError(f"not YAML: {error}") from error
    if not isinstance(document, Mapping) or CONFIG_KEY not in document:
        raise ValueError(f"the file must hold a mapping with the key {CONFIG_KEY}")
    config = document[CONFIG_KEY] or {}
    if not isinstance(config, Mapping):
        raise ValueError(f"{CONFIG_KEY} must be a mapping")
    unknown = set(config) - _IGNORED_KEYS - {"ensureExist", "ensureNotExist"}
    if unknown:
        raise ValueError(f"unknown keys under {CONFIG_KEY}: {', '.join(sorted(unknown))} "
                         "(expected ensureExist and ensureNotExist)")
    present: dict[str, str] = {}
    for model in _models(config.get("ensureExist"), "ensureExist"):
        name = _adapter_id(model, "ensureExist")
        source = model.get("source")
        if not isinstance(source, str) or not source:
            raise ValueError(f"adapter {name!r} in ensureExist needs a source: the adapter's "
                             "directory, as the server sees it")
        if present.get(name, source) != source:
            raise ValueError(f"adapter {name!r} is listed twice in ensureExist with different "
                             "sources")
        present[name] = source
    absent = frozenset(_adapter_id(model, "ensureNotExist")
                       for model in _models(config.get("ensureNotExist"), "ensureNotExist"))
    both = absent & present.keys()
    if both:
        raise ValueError(f"listed in both ensureExist and ensureNotExist: {', '.join(sorted(both))}")
    return WantedAdapters(present, absent)


def render_config(present: Mapping[str, str] | None = None,
                  absent: frozenset[str] = frozenset()) -> str:
    """A config file asking for ``present`` (name -> source) and against ``absent``."""
    config = {CONFIG_KEY: {
        "ensureExist": {"models": [{"id": name, "source": source}
                                   for name, source in (present or {}).items()]},
        "ensureNotExist": {"models": [{"id": name} for name in sorted(absent)]},
    }}
    return yaml.safe_dump(config, sort_keys=False)


class LoraSyncer:
    """Brings the server behind ``client`` to the wanted adapters."""

    def __init__(self, client: Client) -> None:
        self.client = client
        # The source this syncer loaded each adapter from: a changed source means a reload.
        self._sources: dict[str, str] = {}
        # Refusals that retrying the same request cannot fix, until the wanted set changes.
        self._refused: dict[tuple[str, str], str] = {}

    def forget_refusals(self) -> None:
        self._refused.clear()

    def sync(self, wanted: WantedAdapters) -> SyncOutcome:
        """One pass; raises ``TandemError`` when the server cannot be asked at all."""
        outcome = SyncOutcome()
        served = {model.id for model in self.client.models() if model.parent is not None}
        for name in sorted(wanted.absent & served):
            self._change(outcome, name, "", unload=True)
        for name, source in wanted.present.items():
            if name in served:
                if self._sources.get(name, source) == source:
                    continue  # loaded from this source, or by someone else: leave it
                if not self._change(outcome, name, "", unload=True):
                    continue
            if (name, source) in self._refused:
                continue
            self._change(outcome, name, source, unload=False)
        return outcome

    def _change(self, outcome: SyncOutcome, name: str, source: str, *, unload: bool) -> bool:
        try:
            if unload:
                self.client.unload_lora_adapter(name)
            else:
                self.client.load_lora_adapter(name, source)
        except TandemError as error:
            if unload and error.code == grpc.StatusCode.NOT_FOUND:
                return True  # gone already (another client, or a restart in between)
            why = f"{error.details} ({error.code.name})"
            if not unload and (isinstance(error, InvalidRequestError)
                               or error.code in _PERMANENT_CODES):
                self._refused[(name, source)] = why
            outcome.failed[name] = why
            return False
        if unload:
            outcome.unloaded.append(name)
            self._sources.pop(name, None)
        else:
            outcome.loaded.append(name)
            self._sources[name] = source
        return True

    def run(self, config: Path, interval_s: float, stop: threading.Event) -> None:
        """Syncs on every change of ``config`` and every ``interval_s`` until ``stop``."""
        text: str | None = None
        wanted: WantedAdapters | None = None
        server_was_down = unreadable = False
        while not stop.is_set():
            new_text: str | None
            try:
                new_text = config.read_text()
                unreadable = False
            except OSError as error:
                new_text = text
                if not unreadable:
                    logger.warning("cannot read %s (%s); keeping the adapters as they are",
                                   config, error)
                unreadable = True
            if new_text != text:
                text = new_text
                try:
                    wanted = parse_wanted_adapters(text or "")
                    logger.info("%s: want %s; not %s", config,
                                ", ".join(f"{name} from {source}" for name, source
                                          in sorted(wanted.present.items())) or "no adapters",
                                ", ".join(sorted(wanted.absent)) or "-")
                except ValueError as error:
                    logger.error("%s: %s; keeping the previous adapters", config, error)
                self.forget_refusals()
            if wanted is not None:
                try:
                    outcome = self.sync(wanted)
                except TandemError as error:
                    if not server_was_down:
                        logger.warning("the server does not answer (%s); retrying every "
                                       "%.1f s", error, interval_s)
                    server_was_down = True
                else:
                    server_was_down = False
                    _log_outcome(outcome)
            stop.wait(interval_s)


def _log_outcome(outcome: SyncOutcome) -> None:
    for name in outcome.unloaded:
        logger.info("unloaded %s", name)
    for name in outcome.loaded:
        logger.info("loaded %s", name)
    for name, why in outcome.failed.items():
        logger.error("%s: %s", name, why)
