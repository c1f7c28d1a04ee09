"""A failure in one sequence stays in that sequence: with 8 sequences in flight on the reference backend and on the
cuda backend (CPU emulator), a fault injected into one sequence at each stage (prefill, decode, logits processing,
grammar, speculative verify) finishes it alone with its own error, while the other seven produce exactly what they
produce alone and the engine stays healthy."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from thorgen.runtime.backend import EngineStateLost, SamplingParams, SequenceFailed  # noqa: E402
from thorgen.runtime.engine.core import EngineCore  # noqa: E402

N_SEQS, NEW_TOKENS, VICTIM = 8, 5, "r3"


def _requests() -> dict[str, tuple[list[int], SamplingParams]]:
    """8 requests of different lengths, greedy and seeded (every one its own seed: the injections find the victim
    by it)."""
    out = {}
    for i in range(N_SEQS):
        prompt = [2] + [110 + (i * 37 + 11 * j) % 400 for j in range(2 + i % 3)]
        sp = SamplingParams(temperature=0.9, top_k=40, seed=100 + i) if i % 2 else SamplingParams(seed=100 + i)
        out[f"r{i}"] = (prompt, sp)
    return out


VICTIM_SEED = _requests()[VICTIM][1].seed


def _serve(core: EngineCore, requests: dict, speculative: bool = False) -> tuple[dict, dict]:
    """Run `requests` together to the end: (tokens of each request, the error of each that failed)."""
    for rid, (prompt, sp) in requests.items():
        core.add(rid, prompt, NEW_TOKENS, sp, speculative=speculative)
    tokens, errors = {rid: [] for rid in requests}, {}
    for _ in range(500):
        if not core.unfinished:
            return tokens, errors
        for out in core.step():
            tokens[out.request_id] += out.token_ids
            if out.error is not None:
                errors[out.request_id] = out.error
    raise AssertionError("the engine did not finish")


def _check_isolated(
    runner_for: Callable[[int], object],
    inject: Callable[[object], None],
    alone: dict,
    requests: dict | None = None,
    speculative: bool = False,
    request_fault: bool = False,
) -> None:
    requests = requests or _requests()
    runner = runner_for(N_SEQS)
    before = dict(vars(runner))
    inject(runner)
    core = EngineCore(runner)
    tokens, errors = _serve(core, requests, speculative)
    assert set(errors) == {VICTIM}, errors
    error = errors[VICTIM]
    assert isinstance(error, SequenceFailed) and error.request_id == VICTIM
    assert error.request_fault is request_fault, error
    assert str(error).startswith(f"request {VICTIM}:") and not any(
        f"r{i}" in str(error).replace(VICTIM, "") for i in range(N_SEQS)
    ), error
    for rid in requests:
        if rid != VICTIM:
            assert tokens[rid] == alone[rid], f"{rid}: {tokens[rid]} beside the fault, {alone[rid]} alone"
    assert core.unfinished == 0 and core.kv.used_pages == 0  # the victim's pages came back too
    # the engine is healthy: the same runner, its fault taken out, serves the victim's plain request as if alone
    vars(runner).clear()
    vars(runner).update(before)
    again, errors = _serve(EngineCore(runner), {VICTIM: _requests()[VICTIM]}, speculative)
    assert errors == {} and again[VICTIM] == alone[VICTIM]


def _alone(runner_for, requests: dict, speculative: bool = False) -> dict:
    return {rid: _serve(EngineCore(runner_for(1)), {rid: req}, speculative)[0][rid] for rid, req in requests.items()}


def _is_victim(sampling: SamplingParams) -> bool:
    return sampling.seed == VICTIM_SEED


def _overflowing(sp: SamplingParams) -> SamplingParams:
    """`sp` with repetition_penalty 1e-300, past SamplingParams' own check (as a request might once have been)."""
    out = replace(sp, repetition_penalty=2.0)
    object.__setattr__(out, "repetition_penalty", 1e-300)
    return out


class FailingGrammar:
    """A grammar that allows every token; its matcher raises at the `at`-th token it is given (in `accept`), or
    when asked for its mask then (`in_mask`)."""

    def __init__(self, at: int, in_mask: bool = False) -> None:
        self.at, self.in_mask = at, in_mask

    def matcher(self) -> "FailingGrammar.Matcher":
        return FailingGrammar.Matcher(self)

    class Matcher:
        def __init__(self, grammar: "FailingGrammar") -> None:
            self.grammar, self.accepted = grammar, 0

        def allowed(self, vocab: int) -> np.ndarray:
            if self.grammar.in_mask and self.accepted == self.grammar.at:
                raise RuntimeError("grammar state corrupted")
            return np.ones(vocab, bool)

        def accept(self, token: int) -> None:
            self.accepted += 1
            if not self.grammar.in_mask and self.accepted == self.grammar.at:
                raise RuntimeError("grammar state corrupted")


def _with_victim(sampling_of: Callable[[SamplingParams], SamplingParams]) -> dict:
    requests = _requests()
    prompt, sp = requests[VICTIM]
    requests[VICTIM] = (prompt, sampling_of(sp))
    return requests


# -- the reference backend ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    from thorgen.runtime.reference.backend import ReferenceBackend

    backend = ReferenceBackend(tiny_ckpt, max_context=128, prefix_cache=False)
    return backend, _alone(backend.runner, _requests())


def _failing_decoder(runner, method: str, when: Callable[..., bool]) -> None:
    """Make the runner's decoder `method` raise for the victim when `when(*args)` holds."""
    decoder = runner.decoder
    real = getattr(type(decoder), method)

    class Faulty(type(decoder)):
        pass

    def faulty(self, state, *args, **kwargs):
        if when(*args):
            raise RuntimeError("injected fault")
        return real(self, state, *args, **kwargs)

    setattr(Faulty, method, faulty)
    clone = Faulty.__new__(Faulty)
    clone.__dict__.update(decoder.__dict__)
    runner.decoder = clone


def test_reference_prefill_fault(reference):
    backend, alone = reference
    _check_isolated(
        backend.runner,
        lambda r: _failing_decoder(r, "prefill", lambda ids, sampling, *rest: _is_victim(sampling)),
        alone,
    )


def test_reference_decode_fault(reference):
    backend, alone = reference
    _check_isolated(
        backend.runner,
        lambda r: _failing_decoder(r, "step", lambda tok, start, sampling, *rest: _is_victim(sampling) and start >= 5),
        alone,
    )


def test_reference_logits_processing_overflow_is_the_requests_fault(reference):
    backend, alone = reference
    _check_isolated(backend.runner, lambda r: None, alone, _with_victim(_overflowing), request_fault=True)


@pytest.mark.parametrize("in_mask", [False, True])
def test_reference_grammar_fault(reference, in_mask):
    backend, alone = reference
    _check_isolated(
        backend.runner, lambda r: None, alone, _with_victim(lambda sp: replace(sp, grammar=FailingGrammar(3, in_mask)))
    )


def test_reference_speculative_verify_fault(reference):
    """Every sequence decodes speculatively (draft + verify); the victim's verify block fails."""
    backend, _ = reference
    alone = _alone(backend.runner, _requests(), speculative=True)
    _check_isolated(
        backend.runner,
        lambda r: _failing_decoder(
            r,
            "step",
            lambda tok, start, sampling, speculative, *rest: _is_victim(sampling) and speculative and start >= 4,
        ),
        alone,
        speculative=True,
    )


def _failing_decode(runner, error: Callable[[], Exception]) -> None:
    """Make a decode step that holds the victim raise `error()` as a whole (before the runner changes anything),
    from the victim's second decode step on."""
    decode, seen = runner.decode, []

    def faulty(seqs, launched=None):
        if any(s.request_id == VICTIM for s in seqs):
            seen.append(1)
            if len(seen) >= 2:
                raise error()
        return decode(seqs, launched)

    runner.decode = faulty


@pytest.mark.parametrize("named", [True, False])
def test_reference_whole_step_failure_finds_its_culprit(reference, named):
    """A batched step that raises as a whole: run again without the sequence its SequenceFailed names, or (an
    error naming nobody) each sequence alone; the one that fails alone is the culprit."""
    backend, alone = reference
    error = (lambda: SequenceFailed(VICTIM, "injected fault")) if named else (lambda: RuntimeError("injected"))
    _check_isolated(backend.runner, lambda r: _failing_decode(r, error), alone)


def test_a_state_losing_fault_leaves_the_core(reference):
    backend, _ = reference
    runner = backend.runner(N_SEQS)
    _failing_decode(runner, lambda: EngineStateLost("device state unknown"))
    with pytest.raises(EngineStateLost):
        _serve(EngineCore(runner), _requests())


# -- the cuda backend on the CPU emulator ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def emulated(tiny_checkpoint, tmp_path_factory):
    pytest.importorskip("thorgen.codegen.plan")  # the fake manifest comes from codegen's real plan
    import engine_emulator as EE
    from thorgen.runtime.cuda import device as dev

    backend = EE.open_emulated(tiny_checkpoint, tmp_path_factory.mktemp("faults"), ctx=128, max_num_seqs=N_SEQS)
    try:
        yield backend, _alone(backend.runner, _requests())
    finally:
        backend.close()
        dev.set_driver(None)


def test_cuda_prefill_fault(emulated):
    backend, alone = emulated

    def inject(runner) -> None:
        prefill = runner.prefill

        def faulty(seq, *args, **kwargs):
            if seq.request_id == VICTIM:
                raise RuntimeError("injected fault")
            return prefill(seq, *args, **kwargs)

        runner.prefill = faulty

    _check_isolated(backend.runner, inject, alone)


@pytest.mark.parametrize("named", [True, False])
def test_cuda_decode_fault(emulated, named):
    backend, alone = emulated
    error = (lambda: SequenceFailed(VICTIM, "injected fault")) if named else (lambda: RuntimeError("injected"))
    _check_isolated(backend.runner, lambda r: _failing_decode(r, error), alone)


def test_cuda_logits_processing_overflow_is_the_requests_fault(emulated):
    """The victim's row of the batched lm_process reports a non-finite value; the other rows commit."""
    backend, alone = emulated
    _check_isolated(backend.runner, lambda r: None, alone, _with_victim(_overflowing), request_fault=True)


@pytest.mark.parametrize("in_mask", [False, True])
def test_cuda_grammar_fault(emulated, in_mask):
    backend, alone = emulated
    _check_isolated(
        backend.runner, lambda r: None, alone, _with_victim(lambda sp: replace(sp, grammar=FailingGrammar(3, in_mask)))
    )


# -- through HTTP ---------------------------------------------------------------------------------------------------


def _stream_text(url: str, body: dict) -> str:
    import httpx

    with httpx.stream("POST", url + "/v1/chat/completions", json=dict(body, stream=True), timeout=60) as r:
        assert r.status_code == 200, r.read()
        return "".join(r.iter_text())


def _content(text: str) -> str:
    import json

    return "".join(
        json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
        for line in text.splitlines()
        if line.startswith("data: {") and '"choices": [{' in line
    )


def test_http_bad_penalty_is_a_400_beside_an_intact_stream(tiny_checkpoint):
    """repetition_penalty 1e-300 once made the shared step raise, failing every stream; now it is refused
    before generation and the concurrent stream ends as it does alone."""
    import json
    import threading

    import httpx
    from tiny_server import tiny_server

    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "tell a story"}],
        "max_tokens": 24,
        "temperature": 0,
    }
    with tiny_server(tiny_checkpoint, 256) as (url, state):
        alone = _stream_text(url, body)
        beside: dict = {}
        t = threading.Thread(target=lambda: beside.setdefault("text", _stream_text(url, body)))
        t.start()
        bad = [
            httpx.post(
                url + "/v1/chat/completions",
                content=json.dumps(dict(body, **extra)),
                timeout=30,
                headers={"content-type": "application/json"},
            )  # (json.dumps writes Infinity)
            for extra in (
                {"repetition_penalty": 1e-300},
                {"repetition_penalty": 1e300},
                {"logit_bias": {"5": float("inf")}},
                {"temperature": float("inf")},
                {"top_p": float("nan")},
            )
        ]
        t.join(60)
        for r in bad:
            assert r.status_code == 400, r.text
            assert r.json()["error"]["type"] == "invalid_request_error"
        assert "repetition_penalty" in bad[0].json()["error"]["message"]
        assert _content(beside["text"]) == _content(alone) and beside["text"].rstrip().endswith("data: [DONE]")
        assert state.client.health()["status"] == "ok"


def test_http_unknown_model_is_a_404_and_served_names_are_listed(tiny_checkpoint):
    import httpx
    from thorgen.runtime.api import EngineConfig
    from thorgen.serve.app import ServerState, create_app
    from thorgen.serve.cli import open_model
    from scripted_backend import running_server

    state = ServerState(
        "gemma", lambda: open_model(EngineConfig(tiny_checkpoint, "reference", 128)), model_names=("gemma", "alias/two")
    )
    state.load()
    try:
        with running_server(create_app(state)) as url:
            msgs = [{"role": "user", "content": "hi"}]
            r = httpx.post(url + "/v1/chat/completions", json={"model": "nope", "messages": msgs}, timeout=30)
            assert r.status_code == 404
            assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["param"] == "model"
            assert "'nope'" in r.json()["error"]["message"]
            r = httpx.post(url + "/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=30)
            assert r.status_code == 404
            for name in ("gemma", "alias/two", None):  # every served name, and no name at all (as before)
                body = {"messages": msgs, "max_tokens": 2} | ({"model": name} if name else {})
                r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
                assert r.status_code == 200 and r.json()["model"] == "gemma", r.text
            assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["gemma", "alias/two"]
            assert httpx.get(url + "/v1/models/alias/two").status_code == 200
            assert httpx.get(url + "/v1/models/nope").status_code == 404
    finally:
        state.close()


def test_served_model_name_flag_takes_several_names():
    import click
    from click.testing import CliRunner
    from thorgen.serve.cli import NamesOption

    @click.command()
    @click.option("--served-model-name", "--model-name", "names", cls=NamesOption, multiple=True)
    @click.option("--port", default=0)
    def probe(names, port):
        click.echo(f"{list(names)} {port}")

    run = CliRunner().invoke
    assert run(probe, ["--served-model-name", "a", "b/c", "--port", "3"]).output.strip() == "['a', 'b/c'] 3"
    assert run(probe, ["--model-name", "a", "--served-model-name", "d"]).output.strip() == "['a', 'd'] 0"


def _scripted(delay: float = 0.0):
    from thorgen.runtime.text.tokenizer import Tokenizer
    from thorgen.serve.chat_template import ChatTemplate
    from scripted_backend import ScriptedBackend, scripted_state, write_test_tokenizer
    import tempfile

    tok = Tokenizer.from_file(write_test_tokenizer(Path(tempfile.mkdtemp()) / "tokenizer.json"))
    engine = ScriptedBackend(lambda p: tok.encode("a long reply " * 40), delay=delay)
    template = ChatTemplate(
        (Path(__file__).resolve().parent.parent / "model_spec" / "synth" / "chat_template.jinja").read_text()
    )
    return engine, scripted_state(engine, tok, template)


def test_shutdown_deadline_ends_streams_with_an_error_event_and_done():
    import socket
    import threading
    import time

    import httpx
    import uvicorn
    from thorgen.serve.app import GracefulServer, create_app

    _, state = _scripted(delay=0.05)  # ~25 s for the whole reply: still running at the deadline
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = GracefulServer(uvicorn.Config(create_app(state), log_level="warning", lifespan="off"), state, 0.5)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            started = time.monotonic()
            server.should_exit = True
            rest = [line for line in lines if line]
        waited = time.monotonic() - started
    finally:
        thread.join(10)
        state.close()
    assert rest[-1] == "data: [DONE]", rest[-3:]
    assert '"error"' in rest[-2] and "shutting down" in rest[-2], rest[-2]
    assert 0.4 <= waited < 0.5 + GracefulServer.END_GRACE_S, waited
    assert not thread.is_alive()


def test_engine_fault_fails_its_requests_by_their_own_ids_and_recovers():
    """A step that loses the engine's state fails the requests in it (500s naming only themselves); the engine
    rebuilds, /health says so, and the next request is served."""
    import httpx
    from scripted_backend import running_server
    from thorgen.serve.app import create_app

    engine, state = _scripted()
    with running_server(create_app(state)) as url:
        decode = state.client.core.runner.decode

        def lost(seqs, launched=None):
            if len(seqs[0].output) >= 2:
                raise EngineStateLost("an illegal address on the device")
            return decode(seqs, launched)

        state.client.core.runner.decode = lost
        texts = {}
        import threading

        threads = [
            threading.Thread(
                target=lambda i=i: texts.setdefault(
                    i, _stream_text(url, {"model": "m", "messages": [{"role": "user", "content": f"hi {i}"}]})
                )
            )
            for i in range(3)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        failed = [text for text in texts.values() if "server_error" in text]
        assert failed and all(text.rstrip().endswith("data: [DONE]") for text in texts.values())
        for text in failed:
            ids = {w for w in text.replace(":", " ").split() if w.startswith("req-")}
            assert len(ids) == 1, text  # its own request id, nobody else's
        for text in texts.values():  # (one that arrived after the rebuild ran whole)
            assert text in failed or _content(text).strip() == ("a long reply " * 40).strip()
        health = httpx.get(url + "/health").json()
        assert health["status"] == "ok" and health["recoveries"] >= 1 and health["last_recovery_s"] >= 0
        r = httpx.post(
            url + "/v1/chat/completions",
            timeout=30,
            json={"model": "m", "messages": [{"role": "user", "content": "again"}], "max_tokens": 4},
        )
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "a lo"
    state.close()


def test_engine_that_cannot_be_rebuilt_reports_failed():
    import httpx
    from scripted_backend import running_server
    from thorgen.serve.app import create_app

    engine, state = _scripted()
    client = state.client

    def no_reopen():
        raise OSError("the device is gone")

    client._opener = no_reopen
    with running_server(create_app(state)) as url:
        client.core.runner.decode = lambda seqs, launched=None: (_ for _ in ()).throw(EngineStateLost("lost"))
        r = httpx.post(
            url + "/v1/chat/completions",
            timeout=30,
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert r.status_code == 500
        client._thread.join(10)
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "failed"
        assert "the device is gone" in health.json()["error"]
        r = httpx.post(
            url + "/v1/chat/completions",
            timeout=30,
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert r.status_code == 503
    state.close()


def test_http_detokenize_fault_ends_its_stream_alone(monkeypatch):
    """8 streams; decoding one's output fails (its parser raises): it ends with an error event and [DONE], the
    other seven stream exactly their own replies."""
    import re
    import threading

    from scripted_backend import ScriptedBackend, running_server, scripted_state, write_test_tokenizer
    from thorgen.runtime.text.tokenizer import Tokenizer
    from thorgen.serve import pipeline
    from thorgen.serve.app import create_app
    from thorgen.serve.chat_template import ChatTemplate
    import tempfile

    tok = Tokenizer.from_file(write_test_tokenizer(Path(tempfile.mkdtemp()) / "tokenizer.json"))

    def script(prompt: list[int]) -> list[int]:
        return tok.encode("reply to " + re.findall(r"req(\d+)", tok.decode(prompt))[-1] + " ok")

    engine = ScriptedBackend(script, delay=0.005)
    template = ChatTemplate(
        (Path(__file__).resolve().parent.parent / "model_spec" / "synth" / "chat_template.jinja").read_text()
    )
    state = scripted_state(engine, tok, template)

    class FaultyParser(pipeline.OutputParser):
        def feed(self, ids):
            if "FAULT" in (self.fault_marks or ()) and ids:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
            return super().feed(ids)

        def __init__(self, *args, **kwargs):
            self.fault_marks = kwargs.get("stop")
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(pipeline, "OutputParser", FaultyParser)
    texts = {}
    with running_server(create_app(state)) as url:

        def one(i: int) -> None:
            body = {"model": "m", "messages": [{"role": "user", "content": f"req{i}"}]}
            texts[i] = _stream_text(url, body | ({"stop": ["FAULT"]} if i == 3 else {}))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        # the same fault in an Anthropic stream: it ends with Messages' error event
        import httpx

        body = {
            "model": "m",
            "stream": True,
            "max_tokens": 16,
            "stop_sequences": ["FAULT"],
            "messages": [{"role": "user", "content": "req9"}],
        }
        with httpx.stream("POST", url + "/v1/messages", json=body, timeout=60) as r:
            streamed = "".join(r.iter_text())
        assert "event: error" in streamed and "UnicodeDecodeError" in streamed, streamed[-500:]
        assert state.client.health()["status"] == "ok"
    state.close()
    for i, text in texts.items():
        assert text.rstrip().endswith("data: [DONE]")
        if i == 3:
            assert "UnicodeDecodeError" in text and "server_error" in text
        else:
            assert _content(text) == f"reply to {i} ok" and '"error"' not in text
