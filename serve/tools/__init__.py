"""Tools that use a server or an engine: the quality gate over reference traces and the terminal chat client."""
