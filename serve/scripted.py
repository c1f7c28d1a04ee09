"""Serve stage: a scripted Backend (replays given token ids) and a small byte-level tokenizer, for server tests.

The scripted engine lets tests force exact outputs (tool calls, reasoning, delimiters split across steps) that a
random-weight model would never produce; it honours max_tokens, stop ids and cancellation like a real backend.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Iterator

from ..runtime.backend import GenerationResult, SamplingParams, StepOutput

# Gemma-4 control tokens at their real ids (MODEL_FACTS §4.2); the rest of the low ids are unused specials.
GEMMA_SPECIALS = {0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 4: "<mask>", 46: "<|tool>", 47: "<tool|>",
                  48: "<|tool_call>", 49: "<tool_call|>", 50: "<|tool_response>", 51: "<tool_response|>",
                  52: '<|"|>', 98: "<|think|>", 100: "<|channel>", 101: "<channel|>", 105: "<|turn>",
                  106: "<turn|>"}
_CHARS = [chr(c) for c in range(33, 127)] + ["▁", "\n"] + list("éüßあ")
BYTE_BASE = 107 + len(_CHARS)  # <0xXX> = BYTE_BASE + byte; ids stay contiguous


def write_test_tokenizer(path: str | Path) -> Path:
    """A tokenizer.json: Gemma's special ids, one token per ASCII char, byte fallback for everything else."""
    vocab: dict[str, int] = {}
    for i in range(107):
        vocab[GEMMA_SPECIALS.get(i, f"<unused{i}>")] = i
    for i, ch in enumerate(_CHARS):
        vocab[ch] = 107 + i
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = BYTE_BASE + b
    added = [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for s, i in vocab.items() if i < 107]
    doc = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
           "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
           "pre_tokenizer": None, "post_processor": None,
           "decoder": {"type": "Sequence", "decoders": [
               {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
               {"type": "ByteFallback"}, {"type": "Fuse"}]},
           "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                     "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": True, "ignore_merges": False,
                     "vocab": vocab, "merges": []}}
    path = Path(path)
    path.write_text(json.dumps(doc, ensure_ascii=False))
    return path


class ScriptedBackend:
    """Backend protocol: `script(prompt_ids) -> token ids` is replayed `chunk` tokens per step, `delay` s a step."""

    def __init__(self, script: Callable[[list[int]], list[int]], max_context: int = 4096, chunk: int = 1,
                 delay: float = 0.0, vocab_size: int = BYTE_BASE + 256) -> None:
        self.script, self.chunk, self.delay = script, chunk, delay
        self.max_context = max_context
        self.spec = SimpleNamespace(drafter=None, target=SimpleNamespace(vocab_size=vocab_size))
        self.calls: list[dict] = []  # what each generation received and how it ended
        self.lock = threading.Lock()

    def generate_stream(self, prompt_ids: list[int], max_tokens: int, sampling: SamplingParams,
                        stop_ids: frozenset[int] = frozenset(), speculative: bool = False,
                        cancelled: Callable[[], bool] | None = None,
                        result: GenerationResult | None = None) -> Iterator[StepOutput]:
        record = {"prompt": list(prompt_ids), "max_tokens": max_tokens, "sampling": sampling, "end": None,
                  "started": time.perf_counter()}
        self.calls.append(record)
        result = GenerationResult() if result is None else result
        result.prompt_tokens = len(prompt_ids)
        return self._run(list(self.script(list(prompt_ids))), max_tokens, stop_ids, cancelled, result, record)

    def _run(self, tokens, max_tokens, stop_ids, cancelled, result, record) -> Iterator[StepOutput]:
        result.finish_reason = "length"
        try:
            i = 0
            while i < len(tokens) and len(result.token_ids) < max_tokens:
                if cancelled is not None and cancelled():
                    result.finish_reason = "cancelled"
                    break
                if self.delay:
                    time.sleep(self.delay)
                step = []
                for t in tokens[i:i + self.chunk]:
                    if len(result.token_ids) + len(step) >= max_tokens:
                        break
                    step.append(t)
                    if t in stop_ids:
                        break
                i += len(step)
                result.token_ids += step
                try:
                    yield StepOutput(step)
                except GeneratorExit:  # the consumer stopped early (a cancel): report it as such
                    result.finish_reason = "cancelled"
                    raise
                if step and step[-1] in stop_ids:
                    result.finish_reason = "stop"
                    break
            else:
                if len(result.token_ids) < max_tokens:
                    result.finish_reason = "stop"  # the script ended: as if an end-of-turn was produced
        finally:
            record["end"] = result.finish_reason
            record["ended"] = time.perf_counter()

    def generate(self, prompt_ids, max_tokens, sampling, stop_ids=frozenset(), speculative=False, cancelled=None):
        result = GenerationResult()
        for _ in self.generate_stream(prompt_ids, max_tokens, sampling, stop_ids, speculative, cancelled, result):
            pass
        return result


def scripted_state(backend, tokenizer, template, model_id: str = "scripted-test-engine"):
    """A loaded ServerState around any backend, behind an EngineClient (Gemma-4's stops 1, 106, 50)."""
    from ..runtime.api import EngineClient
    from .app import ServerState

    def loader():
        client = EngineClient(lambda: backend)
        client.wait_ready()
        return client, tokenizer, template, {"eos_token_id": [1, 106, 50]}
    state = ServerState(model_id, loader)
    state.load()
    if state.load_error:
        raise RuntimeError(state.load_error)
    return state


@contextmanager
def running_server(app, timeout: float = 10.0) -> Iterator[str]:
    """Serve `app` with uvicorn on a free local port in a daemon thread; yields the base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()
