"""Serve stage: the OpenAI-compatible HTTP server, web UI and terminal client on top of a runtime Backend."""
