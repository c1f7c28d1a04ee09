"""EleutherAI's lm-evaluation-harness, unmodified (its CLI), against `thorgen serve` on the tiny model: a five-question
gsm8k-style task through `local-chat-completions` (generation), and a five-question multiple-choice task through
`local-completions` (loglikelihood: echo + prompt logprobs, several token-id prompts per request, the server's
own tokenizer over /tokenizer_info and /tokenize), both from tests/data/lm_eval, run to the end with a score.

This proves the protocol end to end (chat template, stop strings, seed, the response shapes lm-eval parses), not
the score: the tiny model's weights are random. The tasks are local, so no dataset is downloaded.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

REPO = Path(__file__).resolve().parents[1]
TASK = "thorgen_gsm8k_tiny"
MC_TASK = "thorgen_mc_tiny"


def _run_lm_eval(checkpoint, tmp_path, model: str, endpoint: str, model_args: str, *extra: str):
    """lm-eval's CLI against `thorgen serve` on the tiny model, offline (the task's data is a local JSONL; lm-eval
    must not reach for a hub): (the finished process, the server's /metrics text)."""
    import httpx
    from tiny_server import tiny_server

    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    with tiny_server(checkpoint, ctx=2048) as (url, _state):
        cmd = [
            sys.executable,
            "-m",
            "lm_eval",
            "--model",
            model,
            "--model_args",
            f"model=tiny,base_url={url}{endpoint},num_concurrent=1,max_retries=1," + model_args,
            *extra,
            "--include_path",
            "tests/data/lm_eval",
            "--output_path",
            str(tmp_path / "out"),
            "--log_samples",
        ]
        run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        metrics = httpx.get(url + "/metrics", timeout=10).text
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return run, metrics


@pytest.mark.slow
def test_lm_eval_gsm8k_slice_over_http(tiny_checkpoint, tmp_path):
    items = len((REPO / "tests" / "data" / "lm_eval" / f"{TASK}.jsonl").read_text().splitlines())
    _, metrics = _run_lm_eval(
        tiny_checkpoint,
        tmp_path,
        "local-chat-completions",
        "/v1/chat/completions",
        "tokenized_requests=False",
        "--tasks",
        TASK,
        "--apply_chat_template",
    )
    [results_file] = (tmp_path / "out").rglob("results_*.json")
    result = json.loads(results_file.read_text())["results"][TASK]
    assert result["sample_len"] == items
    for name in ("strict-match", "flexible-extract"):
        assert 0.0 <= result[f"exact_match,{name}"] <= 1.0
    [samples_file] = (tmp_path / "out").rglob(f"samples_{TASK}_*.jsonl")
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    # one line per question and answer filter, each holding the one generation lm-eval got back
    assert {s["doc_id"] for s in samples} == set(range(items)) and all(len(s["resps"]) == 1 for s in samples)
    # every question went through the chat endpoint and was answered
    served = re.search(r'thorgen_requests_total\{endpoint="[^"]*chat[^"]*",status="200"\} (\d+)', metrics)
    assert served and int(served.group(1)) == items, metrics[:2000]


@pytest.mark.slow
def test_lm_eval_multiple_choice_over_http(tiny_checkpoint, tmp_path):
    docs = [
        json.loads(line) for line in (REPO / "tests" / "data" / "lm_eval" / f"{MC_TASK}.jsonl").read_text().splitlines()
    ]
    requests, batch = sum(len(d["choices"]) for d in docs), 2
    _, metrics = _run_lm_eval(
        tiny_checkpoint,
        tmp_path,
        "local-completions",
        "/v1/completions",
        "tokenized_requests=True,tokenizer_backend=remote",
        "--batch_size",
        str(batch),
        "--tasks",
        MC_TASK,
    )
    [results_file] = (tmp_path / "out").rglob("results_*.json")
    result = json.loads(results_file.read_text())["results"][MC_TASK]
    assert result["sample_len"] == len(docs) and 0.0 <= result["acc,none"] <= 1.0
    [samples_file] = (tmp_path / "out").rglob(f"samples_{MC_TASK}_*.jsonl")
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    assert sorted(s["doc_id"] for s in samples) == list(range(len(docs)))
    for s in samples:  # one finite loglikelihood per choice (logged as text), and a 0/1 accuracy
        assert len(s["resps"]) == len(docs[s["doc_id"]]["choices"]) and s["acc"] in (0.0, 1.0)
        assert all(-math.inf < float(r[0][0]) < 0 for r in s["resps"])
    # every batch of `batch` loglikelihood requests was one /v1/completions request with several prompts
    served = re.search(r'thorgen_requests_total\{endpoint="/v1/completions",status="200"\} (\d+)', metrics)
    assert served and int(served.group(1)) == math.ceil(requests / batch), metrics[:2000]
