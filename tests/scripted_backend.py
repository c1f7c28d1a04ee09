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

from thorgen.model_spec.synth.tokenizer import SPECIAL_IDS as GEMMA_SPECIALS
from thorgen.runtime.backend import GenerationResult, SamplingParams, StepOutput
from thorgen.runtime.options import DraftOptions

# Gemma-4 control tokens sit at their real ids (MODEL_FACTS §4.2, GEMMA_SPECIALS); the rest of the low ids are
# unused specials.
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
    added = [
        {
            "id": i,
            "content": s,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for s, i in vocab.items()
        if i < 107
    ]
    doc = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
            ],
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": True,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [],
        },
    }
    path = Path(path)
    path.write_text(json.dumps(doc, ensure_ascii=False))
    return path


class ScriptedBackend:
    """Backend protocol: `script(prompt_ids) -> token ids` is replayed `chunk` tokens per step, `delay` s a step.
    It runs through the engine core like every backend (ScriptedRunner); a script that runs out ends the
    request with a stop id, as if the model had ended its turn."""

    draft_options = DraftOptions()

    def __init__(
        self,
        script: Callable[[list[int]], list[int]],
        max_context: int = 4096,
        chunk: int = 1,
        delay: float = 0.0,
        vocab_size: int = BYTE_BASE + 256,
    ) -> None:
        self.script, self.chunk, self.delay = script, chunk, delay
        self.max_context = max_context
        self.spec = SimpleNamespace(drafter=None, vision=None, target=SimpleNamespace(vocab_size=vocab_size))
        self.calls: list[dict] = []  # what each generation received and how it ended
        self.lock = threading.Lock()

    @property
    def features(self):
        from thorgen.runtime.backend import BackendFeatures

        return BackendFeatures()  # (a script: no drafter, no logits to constrain)

    def close(self) -> None:
        pass

    def runner(self, max_num_seqs: int = 8, kv_tokens: int | None = None) -> "ScriptedRunner":
        return ScriptedRunner(self, max_num_seqs, kv_tokens)

    def generate_stream(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        sampling: SamplingParams,
        stop_ids: frozenset[int] = frozenset(),
        speculative: bool = False,
        cancelled: Callable[[], bool] | None = None,
        result: GenerationResult | None = None,
    ) -> Iterator[StepOutput]:
        from thorgen.runtime.engine.single import generate_one

        return generate_one(
            self.runner(1),
            list(prompt_ids),
            max_tokens,
            sampling,
            frozenset(stop_ids),
            speculative,
            cancelled,
            GenerationResult() if result is None else result,
        )

    def generate(self, prompt_ids, max_tokens, sampling, stop_ids=frozenset(), speculative=False, cancelled=None):
        result = GenerationResult()
        for _ in self.generate_stream(prompt_ids, max_tokens, sampling, stop_ids, speculative, cancelled, result):
            pass
        return result


class ScriptedRunner:
    """The engine core's ModelRunner for ScriptedBackend: each step commits the next `chunk` script tokens."""

    prefill_chunk = None
    verify_block = 1
    lookahead = 0
    caught_up_tokens = 0
    device_memory_used = None
    image_rows_bytes = 0

    def chunks_in_pieces(self, seq) -> bool:
        return False

    def __init__(self, backend: ScriptedBackend, max_num_seqs: int, kv_tokens: int | None) -> None:
        from thorgen.runtime.engine.kv_manager import KVGeometry

        self.backend, self.max_num_seqs = backend, max_num_seqs
        self.max_context = backend.max_context
        tokens = kv_tokens if kv_tokens is not None else max_num_seqs * backend.max_context
        self.kv_geometry = KVGeometry(max_num_seqs, backend.max_context, -(-tokens // 16), prefix_cache=False)
        self._runs: dict[str, tuple[list[int], dict]] = {}

    def media_ready(self, seq, wait, queued=()) -> bool:
        return True

    def check(self, seq) -> None:
        from thorgen.runtime.backend import BackendError

        # a script has no logits to process or report, for its answer or for the prompt
        if seq.sampling.extended or seq.sampling.prompt_logprobs is not None:
            raise BackendError(f"{seq.sampling.describe_extended()} is not supported on the scripted backend")

    def draft_context(self, lane: int) -> int:
        return 0

    def speculative_cost(self, drafts: int, batch: int) -> float:
        return 2.0  # (a script never drafts: the policy's numbers do not matter)

    def apply(self, ops) -> None:
        pass  # (a script holds no K/V)

    def _start(self, seq) -> None:
        """A sequence's first prefill (or its first after a preemption): its script, and a record of the call."""
        record = {
            "prompt": list(seq.prompt),
            "max_tokens": seq.max_tokens,
            "sampling": seq.sampling,
            "end": None,
            "started": time.perf_counter(),
        }
        with self.backend.lock:
            self.backend.calls.append(record)
        self._runs[seq.request_id] = (list(self.backend.script(list(seq.prompt))), record)

    def _next(self, seq, n: int) -> list[int]:
        tokens, _ = self._runs[seq.request_id]
        done = len(seq.output)
        if done >= len(tokens):  # the script ran out: end the turn
            return [min(seq.stop_ids) if seq.stop_ids else 1]
        return tokens[done : done + n]

    def prefill(self, seq, start: int, end: int, sample: bool, launched=None, beside=False) -> int | None:
        if seq.request_id not in self._runs:
            self._start(seq)
        if launched is not None:  # the delay stands for device time: host work may overlap it
            launched()
        if self.backend.delay:
            time.sleep(self.backend.delay)
        return self._next(seq, 1)[0] if sample else None

    def decode(self, seqs: list, launched=None) -> list[tuple[list[int], int]]:
        if launched is not None:
            launched()
        if self.backend.delay:
            time.sleep(self.backend.delay)
        return [(self._next(seq, self.backend.chunk)[: max(seq.room(self.max_context), 1)], 0) for seq in seqs]

    def release(self, seq, finished: bool) -> None:
        if seq.request_id not in self._runs:  # (finished before its first prefill ran)
            return
        _, record = self._runs.pop(seq.request_id)
        if finished:
            record["end"], record["ended"] = seq.finish_reason, time.perf_counter()


# the placeholder names server tests send as `model`; a fixture's server answers to them beside its own name
TEST_MODEL_NAMES = ("m", "x", "tiny")


def scripted_state(backend, tokenizer, template, model_id: str = "scripted-test-engine"):
    """A loaded ServerState around any backend, behind an EngineClient (Gemma-4's stops 1, 106, 50), answering to
    `model_id` and TEST_MODEL_NAMES."""
    from thorgen.runtime.client import EngineClient
    from thorgen.serve.app import ServerState

    def loader():
        client = EngineClient(lambda: backend)
        client.wait_ready()
        return client, tokenizer, template, {"eos_token_id": [1, 106, 50]}

    state = ServerState(model_id, loader, model_names=(model_id, *TEST_MODEL_NAMES))
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
