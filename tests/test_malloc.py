"""How the server and the engine process hold malloc's memory (runtime/process/malloc.py): a process that limits
its arenas keeps to that many however many threads allocate; a trim comes once every so many finished requests,
counted by the server for every HTTP answer (a refused one too) and by the engine process for every request that
finishes in its core."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
from multiprocessing import Pipe

import numpy as np
import pytest

from thorgen.runtime.process import malloc
from thorgen.runtime.process.malloc import Trimmer

glibc = pytest.mark.skipif(malloc._glibc() is None, reason="malloc arenas and malloc_trim are glibc's")

# a fresh interpreter that starts 8 threads, each allocating while the others hold their arenas, after limit_arenas
# when told to; prints the heaps malloc_info lists (one per arena)
_ARENAS = textwrap.dedent(
    """
    import ctypes, os, re, sys, tempfile, threading
    from thorgen.runtime.process import malloc
    if sys.argv[1] == "limit":
        assert malloc.limit_arenas(2)
    libc = malloc._glibc()
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.fopen.restype, libc.fopen.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_char_p]
    libc.malloc_info.argtypes, libc.fclose.argtypes = [ctypes.c_int, ctypes.c_void_p], [ctypes.c_void_p]
    started, done = threading.Barrier(9), threading.Event()
    def work():
        block = libc.malloc(4096)
        started.wait()
        done.wait()
        libc.free(block)
    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    started.wait()
    path = os.path.join(tempfile.mkdtemp(), "info.xml")
    f = libc.fopen(path.encode(), b"w")
    libc.malloc_info(0, f)
    libc.fclose(f)
    done.set()
    for t in threads:
        t.join()
    print(len(re.findall(r"<heap nr=", open(path).read())))
    """
)


def _heaps(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _ARENAS, mode], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


@glibc
def test_limited_arenas_hold_however_many_threads_allocate():
    assert _heaps("free") > 2  # (without the limit the same threads make arenas of their own)
    assert _heaps("limit") <= 2


def test_a_trim_every_so_many_finished_requests():
    trims = []
    trimmer = Trimmer(every=3, trim_fn=lambda: trims.append(1))
    for _ in range(7):
        trimmer.finished()
    trimmer.finished(2)
    assert len(trims) == trimmer.trims == 3
    with pytest.raises(ValueError):
        Trimmer(every=0)


@glibc
def test_trim_runs_on_glibc():
    assert malloc.limit_arenas(malloc.ARENAS) is True
    malloc.trim()  # (True or False: whether a page went back; it must not raise)


def test_the_server_counts_every_answer(tmp_path):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    httpx = pytest.importorskip("httpx")
    from pathlib import Path

    from scripted_backend import ScriptedBackend, running_server, scripted_state, write_test_tokenizer

    from thorgen.runtime.text.tokenizer import Tokenizer
    from thorgen.serve.app import create_app
    from thorgen.serve.chat_template import ChatTemplate

    template = Path(__file__).resolve().parent.parent / "model_spec" / "synth" / "chat_template.jinja"
    tok = Tokenizer.from_file(write_test_tokenizer(tmp_path / "tokenizer.json"))
    engine = ScriptedBackend(lambda prompt: tok.encode("a short reply"), chunk=2)
    state = scripted_state(engine, tok, ChatTemplate(template.read_text()))
    trims: list[int] = []
    state.trimmer = Trimmer(every=2, trim_fn=lambda: trims.append(1))
    chat = {"model": "scripted-test-engine", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    try:
        with running_server(create_app(state)) as url:
            assert httpx.post(url + "/v1/chat/completions", json=chat, timeout=30).status_code == 200
            assert httpx.post(url + "/v1/chat/completions", json={}, timeout=30).status_code == 400
            assert httpx.post(url + "/v1/chat/completions", json=chat | {"stream": True}, timeout=30).is_success
            assert httpx.get(url + "/no/such/path", timeout=30).status_code == 404
    finally:
        state.close()
    assert len(trims) == 2


def test_the_engine_process_counts_finished_requests(tiny_checkpoint):
    from thorgen.runtime.api import EngineConfig, open_backend
    from thorgen.runtime.backend import SamplingParams
    from thorgen.runtime.process.child import EngineSettings, _EngineLoop

    opened = open_backend(EngineConfig(tiny_checkpoint, "reference", 256))
    settings = EngineSettings(lambda: opened, "reference", "bf16", max_num_seqs=2)
    inbox_read, inbox = Pipe(duplex=False)
    outbox, outbox_write = Pipe(duplex=False)
    loop = _EngineLoop(opened, inbox_read, outbox_write, settings)
    trims: list[int] = []
    loop.trimmer = Trimmer(every=2, trim_fn=lambda: trims.append(1))
    try:
        for i, max_tokens in enumerate((2, 3, 4, 5, 6)):
            inbox.send(("add", f"r{i}"))
            body = (np.array([2, 105, 200, 300, 107], np.int32), max_tokens, SamplingParams(), [1], False, [])
            inbox.send_bytes(pickle.dumps(body))
        while loop._receive(block=False) and loop.core.unfinished:
            loop._step()
            while outbox.poll():
                outbox.recv()
    finally:
        opened.backend.close()
    assert not loop.live and len(trims) == 2


def test_the_engine_process_limits_its_arenas_before_it_opens_the_model(monkeypatch):
    from thorgen.runtime.process import child

    calls: list[str] = []
    monkeypatch.setattr(child, "limit_arenas", lambda: calls.append("limit_arenas"))

    def opener():
        calls.append("open")
        raise RuntimeError("no model here")

    inbox, _ = Pipe(duplex=False)
    from_engine, outbox = Pipe(duplex=False)
    child.run_engine(inbox, outbox, child.EngineSettings(opener=opener, backend_name="reference", kv_dtype="bf16"))
    kind, error = from_engine.recv()
    assert calls == ["limit_arenas", "open"] and kind == "load_error" and "no model here" in str(error)
