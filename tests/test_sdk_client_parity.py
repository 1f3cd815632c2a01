"""``Client`` and ``AsyncClient`` offer the same methods, with the same parameters, built on
the same ``tandem.calls``: a method added to one client and not the other, or with other
parameters, fails here. The calls' behaviour is checked against a server in
``test_client_sdk``."""

from __future__ import annotations

import inspect

from tandem import calls
from tandem.client import AsyncClient, Client

# Methods that return an iterator at once rather than an answer (awaited in AsyncClient).
STREAMING = {"complete_stream", "chat_stream", "respond_stream", "follow_response"}


def public_methods(cls: type) -> dict[str, object]:
    return {name: member for name, member in vars(cls).items()
            if callable(member) and not name.startswith("_")}


def test_both_clients_have_the_same_methods_and_parameters() -> None:
    sync, aio = public_methods(Client), public_methods(AsyncClient)
    assert set(sync) == set(aio)
    for name, method in sync.items():
        sync_parameters = inspect.signature(method).parameters  # type: ignore[arg-type]
        aio_parameters = inspect.signature(aio[name]).parameters  # type: ignore[arg-type]
        assert list(sync_parameters.values()) == list(aio_parameters.values()), name
    assert inspect.signature(Client.__init__) == inspect.signature(AsyncClient.__init__)


def test_async_methods_are_awaited_but_streams() -> None:
    for name, method in public_methods(AsyncClient).items():
        assert inspect.iscoroutinefunction(method) == (name not in STREAMING), name
    for method in public_methods(Client).values():
        assert not inspect.iscoroutinefunction(method)


def test_every_method_but_close_has_its_call() -> None:
    """Each method's request and result are built by its namesake in ``tandem.calls``, with
    the same parameters (the generation options gathered into ``options``)."""
    for name, method in public_methods(Client).items():
        if name == "close":
            continue
        call = getattr(calls, name)
        wanted = [p.name if p.kind is not p.VAR_KEYWORD else "options"
                  for p in inspect.signature(method).parameters.values()  # type: ignore[arg-type]
                  if p.name != "self"]
        assert list(inspect.signature(call).parameters) == wanted, name
