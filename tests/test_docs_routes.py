"""docs/serving.md's route table lists exactly the routes the FastAPI app serves, and every route its prose names
in a code span (`/v1/messages`, `POST /tokenize`) is one of them.

The table's convention: one route a row, its first cell `METHOD /path` in a code span, path parameters as FastAPI
writes them without converters (`/v1/models/{model_id}`). A GET route's implicit HEAD is not listed.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

fastapi = pytest.importorskip("fastapi")

REPO = Path(__file__).resolve().parent.parent
SERVING = REPO / "docs" / "serving.md"
TABLE_ROW = re.compile(r"^\| `([A-Z]+) (/[^`]*)` \|", re.MULTILINE)
# a code span holding a route, with or without its method: `/health`, `GET /v1/models`, `/v1/messages/count_tokens`
ROUTE_SPAN = re.compile(r"`(?:(?:GET|POST|PUT|PATCH|DELETE) )?(/[\w{}./-]*)`")


def served(app) -> set[str]:
    """ "METHOD /path" of every route the app answers."""
    # FastAPI 0.16x keeps an included router as one entry of app.routes (iter_route_contexts flattens it);
    # earlier versions list its routes there themselves
    flatten = getattr(fastapi.routing, "iter_route_contexts", iter)
    routes = set()
    for route in flatten(app.routes):
        methods = set(getattr(route, "methods", None) or ())
        if "GET" in methods:
            methods.discard("HEAD")  # Starlette adds it to its own GET routes
        routes |= {f"{method} {route.path_format}" for method in methods}
    return routes


def documented(text: str) -> list[str]:
    return [f"{method} {path}" for method, path in TABLE_ROW.findall(text)]


@pytest.fixture(scope="module")
def app():
    from thorgen.serve.app import ServerState, create_app

    return create_app(ServerState("docs", loader=lambda: None))  # never loaded: the routes need no model


def test_route_table_matches_the_app(app):
    table, routes = documented(SERVING.read_text()), served(app)
    assert len(table) == len(set(table)), "docs/serving.md lists a route twice"
    missing, stale = sorted(routes - set(table)), sorted(set(table) - routes)
    assert not missing, f"served but missing from docs/serving.md's route table: {missing}"
    assert not stale, f"in docs/serving.md's route table but not served: {stale}"


def test_routes_named_in_the_prose_exist(app):
    paths = {route.split(" ", 1)[1] for route in served(app)}
    # a prefix of served paths (`/v1`, which the API key guards) names them all
    unknown = [
        p
        for p in set(ROUTE_SPAN.findall(SERVING.read_text()))
        if p not in paths and not any(q.startswith(p + "/") for q in paths)
    ]
    assert not unknown, f"docs/serving.md names routes the app does not serve: {sorted(unknown)}"


def test_the_parsers_read_what_they_should():
    text = "| `POST /v1/x` | a |\n| `GET /y/{id}` | b |\nprose `/health`, `GET /v1/models` and `thorgen serve`\n"
    assert documented(text) == ["POST /v1/x", "GET /y/{id}"]
    assert ROUTE_SPAN.findall(text) == ["/v1/x", "/y/{id}", "/health", "/v1/models"]
