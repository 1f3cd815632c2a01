"""Tool calls: what a request's tools and ``tool_choice`` make of the output (``plan``) and
the syntaxes models write calls in, parsed as they stream (``parsers``)."""
