"""EleutherAI's lm-evaluation-harness, unmodified (its CLI, `local-chat-completions` model), against `thorgen serve`
on the tiny model: a five-question gsm8k-style task from tests/data/lm_eval runs to the end and yields a score.

This proves the protocol end to end (chat template, stop strings, seed, the response shape lm-eval parses), not
the score: the tiny model's weights are random. The task is local, so no dataset is downloaded.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

REPO = Path(__file__).resolve().parents[1]
TASK = "thorgen_gsm8k_tiny"


@pytest.mark.slow
def test_lm_eval_gsm8k_slice_over_http(tiny_checkpoint, tmp_path):
    import httpx
    from tiny_server import tiny_server

    items = len((REPO / "tests" / "data" / "lm_eval" / f"{TASK}.jsonl").read_text().splitlines())
    # offline: the task's data is a local JSONL; lm-eval must not reach for a hub
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    with tiny_server(tiny_checkpoint, ctx=2048) as (url, _state):
        cmd = [sys.executable, "-m", "lm_eval", "--model", "local-chat-completions",
               "--model_args", f"model=tiny,base_url={url}/v1/chat/completions,num_concurrent=1,max_retries=1,"
                               "tokenized_requests=False",
               "--tasks", TASK, "--include_path", "tests/data/lm_eval", "--apply_chat_template",
               "--output_path", str(tmp_path / "out"), "--log_samples"]
        run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        metrics = httpx.get(url + "/metrics", timeout=10).text
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
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
