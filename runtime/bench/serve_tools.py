"""Serve stage: `thorgen bench serve --tools`: streamed chat requests the way a coding agent sends them, an agent's
system prompt, three tools and tool_choice auto, so that a level measures the server with tool grammars armed
(speculative decoding included: /health's draft counters show how it fared)."""

from __future__ import annotations

from typing import Callable

SYSTEM = (
    "You are a software engineering agent working in the user's repository. Work in small, verifiable steps: "
    "read the relevant files before changing them, run the tests after every change, and explain what you did "
    "in a short summary at the end. Use the tools when you need information you do not have; answer directly "
    "when you already know. Never invent file contents or command output. Prefer minimal diffs that keep the "
    "existing style, and say so when a request is ambiguous instead of guessing."
)


def _function(name: str, description: str, properties: dict, required: list[str]) -> dict:
    schema = {"type": "object", "properties": properties, "required": required}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": schema}}


TOOLS = [
    _function(
        "read_file",
        "Read a text file of the repository, optionally a range of its lines.",
        {
            "path": {"type": "string", "description": "Path relative to the repository root."},
            "start_line": {"type": "integer", "minimum": 1},
            "end_line": {"type": "integer", "minimum": 1},
        },
        ["path"],
    ),
    _function(
        "run_command",
        "Run a shell command in the repository root and return its exit code, stdout and stderr.",
        {
            "command": {"type": "string"},
            "timeout_s": {"type": "integer", "minimum": 1, "maximum": 600},
        },
        ["command"],
    ),
    _function(
        "search_code",
        "Search the repository for a regular expression; returns matching lines with their paths.",
        {
            "pattern": {"type": "string"},
            "glob": {"type": "string", "description": "Only files whose path matches this glob."},
            "max_results": {"type": "integer", "minimum": 1, "maximum": 200},
        },
        ["pattern"],
    ),
]


def tool_chats(text: str, fields: dict) -> Callable[[int], tuple[str, dict]]:
    """Streamed chats with the agent's system prompt, its tools (tool_choice auto) and `text` as the user's turn,
    numbered per request so that no prefix cache serves the user's turn."""

    def make(i: int) -> tuple[str, dict]:
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Task {i}: {text}"},
        ]
        return "/v1/chat/completions", {"messages": messages, "tools": TOOLS, "tool_choice": "auto", **fields}

    return make
