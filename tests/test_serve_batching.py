"""Serve-stage test of continuous batching on the reference backend (tiny checkpoint): 64 concurrent clients
through HTTP over a KV cache too small to hold them all (they queue, and some are preempted), each answered with
exactly the tokens it gets alone (greedy and seeded); a prompt that needs more KV than the whole cache gets a
clear 400."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("fastapi")

from thorgen.runtime.api import EngineConfig, open_backend  # noqa: E402
from thorgen.runtime.client import EngineClient  # noqa: E402
from thorgen.serve.app import ServerState, create_app  # noqa: E402
from thorgen.runtime.text.prompts import load_chat_template  # noqa: E402
from thorgen.serve.chat_template import ChatTemplate, load_tokenizer  # noqa: E402
from scripted_backend import TEST_MODEL_NAMES, running_server  # noqa: E402


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    def loader():
        config = EngineConfig(tiny_checkpoint, "reference", ctx=256, max_num_seqs=16)
        holder = {}
        # 128 K/V entries for up to 16 sequences: requests queue for blocks, and some are preempted
        client = EngineClient(
            lambda: holder.setdefault("m", open_backend(config)).backend, max_num_seqs=16, kv_tokens=128
        )
        client.wait_ready()
        model = holder["m"]
        source, bos = load_chat_template(model.model_dir, model.chat_template)
        return client, load_tokenizer(model.tokenizer_path), ChatTemplate(source, bos), model.generation_config

    state = ServerState("tiny", loader, model_names=("tiny", *TEST_MODEL_NAMES))
    state.load()
    assert state.load_error is None, state.load_error
    with running_server(create_app(state)) as url:
        yield url
    state.close()


def _ids(url: str, prompt: list[int], **extra) -> list[int]:
    body = {"model": "m", "prompt": prompt, "max_tokens": 6, "return_token_ids": True, **extra}
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


@pytest.mark.parametrize(
    "sampling", [{"temperature": 0}, {"temperature": 1.0, "top_k": 50, "seed": 3}], ids=["greedy", "seeded"]
)
def test_64_concurrent_clients_get_their_own_tokens(server, sampling):
    prompts = [[2, 105] + [110 + (7 * i + j) % 300 for j in range(3 + i % 9)] + [107] for i in range(64)]
    alone = [_ids(server, p, **sampling) for p in prompts[:8]]  # alone, one after another
    with ThreadPoolExecutor(64) as pool:
        together = list(pool.map(lambda p: _ids(server, p, **sampling), prompts))
    assert together[:8] == alone
    assert len({tuple(t) for t in together}) > 1  # different prompts, not one answer copied to all


def test_prompt_over_the_kv_cache_is_a_400(server):
    r = httpx.post(server + "/v1/completions", json={"model": "m", "prompt": [2] + [120] * 200, "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert "needs 13 KV blocks of 16 tokens, but the whole KV cache holds 8 blocks" in r.json()["error"]["message"]
