"""``tokcap engine`` as a child process, the way other parts' tests start it."""

from __future__ import annotations

import subprocess
import sys

import httpx

from tests.support.servers import free_port, run_process
from tokcap_devtools.engine.ground_truth import read_jsonl


def test_engine_process_serves_and_writes_ground_truth(tmp_path):
    port = free_port()
    truth = tmp_path / "truth" / "engine.jsonl"
    script = tmp_path / "script.yaml"
    script.write_text("entries:\n  - match: ping\n    text: pong\ndefault:\n  text: other\n")
    generation = tmp_path / "generation.yaml"
    generation.write_text("temperature: 0.5\ntop_p: 0.9\nmax_tokens: 64\n")
    args = [
        "python",
        "-m",
        "tokcap_devtools.engine.cli",
        "--port",
        str(port),
        "--model",
        "m1",
        "--script",
        str(script),
        "--seed",
        "4",
        "--ground-truth",
        str(truth),
        "--max-model-len",
        "4096",
        "--noncanonical-rate",
        "0",
        "--generation-config",
        str(generation),
    ]
    base = f"http://127.0.0.1:{port}"
    with run_process(args, ready_url=f"{base}/health"):
        body = {
            "model": "m1",
            "messages": [{"role": "user", "content": "ping"}],
            "return_token_ids": True,
            "logprobs": True,
        }
        reply = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30).json()
        assert reply["choices"][0]["message"]["content"] == "pong"
        other = httpx.post(
            f"{base}/v1/chat/completions",
            timeout=30,
            json={**body, "messages": [{"role": "user", "content": "hi"}]},
        ).json()
        assert other["choices"][0]["message"]["content"] == "other"
        capped = httpx.post(
            f"{base}/v1/chat/completions", timeout=30, json={**body, "max_tokens": 2}
        ).json()
        assert capped["choices"][0]["finish_reason"] == "length"
        explicit = httpx.post(
            f"{base}/v1/chat/completions",
            timeout=30,
            json={**body, "temperature": 0.5, "top_p": 0.9},
        ).json()
        hot = httpx.post(
            f"{base}/v1/chat/completions",
            timeout=30,
            json={**body, "temperature": 1.0, "top_p": 1.0},
        ).json()
        assert explicit["choices"][0]["logprobs"] == reply["choices"][0]["logprobs"]
        assert hot["choices"][0]["logprobs"] != reply["choices"][0]["logprobs"]
        served = httpx.get(f"{base}/tokcap/ground_truth").json()
        models = httpx.get(f"{base}/v1/models").json()
    assert models["data"][0]["id"] == "m1" and models["data"][0]["max_model_len"] == 4096
    logged = read_jsonl(truth)
    assert logged == served and len(logged) == 5
    assert logged[0]["token_ids"] == reply["choices"][0]["token_ids"]
    assert logged[0]["prompt_token_ids"] == reply["prompt_token_ids"]
    assert logged[0]["logprobs"] == [
        e["logprob"] for e in reply["choices"][0]["logprobs"]["content"]
    ]


def test_tokcap_cli_has_the_engine_subcommand():
    result = subprocess.run(
        [sys.executable, "-m", "tokcap.cli", "engine", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0
    for flag in (
        "--policy",
        "--script",
        "--noncanonical-rate",
        "--think-strip",
        "--json-reserialize",
        "--ground-truth",
        "--max-model-len",
        "--wire",
        "--api-key",
        "--logprobs-mode",
    ):
        assert flag in result.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "tokcap_devtools.engine.cli", "--noncanonical-rate", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "noncanonical_rate" in bad.stderr
