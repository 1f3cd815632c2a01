"""Structured outputs: constraining a request's tokens to a grammar (JSON schema, regex, ...)."""
