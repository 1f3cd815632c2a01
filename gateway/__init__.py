"""Tandem's gateway: routes each request to replicas by the prefix cache and load they publish."""
