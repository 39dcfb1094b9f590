"""The Batch API with vLLM as the catalogue model's engine (`engine: server`, vLLM's CPU
build): the batch's worker starts vLLM beside its llm stage; vLLM is SIGKILLed mid-job, started
again, and every request is answered once, with vLLM's own greedy answer to it and the model's
tokenizer's count of its prompt."""

from __future__ import annotations

import asyncio
import contextlib
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from ebb.worker.llm.prompts import PromptCodec

from ..helpers import command_line
from ..llm_model import corpus
from ..vllm_server import VLLMServer, vllm_command, vllm_processes
from .conftest import chat_line, client, create, gateway_config, jsonl, lines_of, started, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MAX_TOKENS = 16


def _job_s_vllm(other_than: int) -> psutil.Process | None:
    """The vLLM API server a batch's worker started (not the test's own on `other_than`)."""
    for p in psutil.Process().children(recursive=True):
        line = command_line(p).split()
        if "vllm.entrypoints.openai.api_server" in line and str(other_than) not in line:
            parent = p.parent()
            if parent is None or "vllm.entrypoints" not in command_line(parent):
                return p
    return None


def _port(process: psutil.Process) -> int:
    line = command_line(process).split()
    return int(line[line.index("--port") + 1])


def _answered(port: int) -> float:
    """Requests vLLM has finished (its own Prometheus counter); 0 before it answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as reply:
            text = reply.read().decode()
    except OSError:
        return 0.0
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total{")
    )


async def test_a_batch_through_vllm_answers_every_request_once_though_vllm_is_killed(
    tmp_path: Path, bos_llm: Path, vllm_server: VLLMServer, prefix: str
) -> None:
    models = {
        "tiny-chat": {
            "stage": {
                "llm": {
                    "model": str(bos_llm),
                    "engine": "server",
                    "command": vllm_command(),
                    "served_model": "tiny",
                    "max_in_flight": 4,
                    "sampling": {"max_tokens": MAX_TOKENS, "temperature": 0.0},
                },
                "batch_size": 16,
            },
            "resources": {"max_workers": 1},
            "rows_per_shard": 20,
        }
    }
    config = gateway_config(tmp_path, bos_llm, models=models)
    lines = [chat_line(f"q-{i}", text) for i, text in enumerate(corpus(40, seed=31))]
    before = vllm_processes()  # the test's own server's
    async with started(tmp_path, bos_llm, prefix, config) as stack:
        oa = client(stack)
        uploaded = await asyncio.to_thread(
            oa.files.create, file=("requests.jsonl", jsonl(lines)), purpose="batch"
        )
        batch = await asyncio.to_thread(create, oa, uploaded.id)
        deadline = time.monotonic() + 400
        while True:
            server = _job_s_vllm(other_than=vllm_server.port)
            if server is not None and _answered(_port(server)) >= 3:
                break
            assert time.monotonic() < deadline, "the batch's vLLM answered nothing"
            await asyncio.sleep(0.1)
        server.kill()  # as the OOM killer would, mid-job
        done = await wait_for(oa, batch.id, timeout_s=600)
        assert done.status == "completed", done
        output = lines_of(oa, done.output_file_id)
        assert lines_of(oa, done.error_file_id) == []
    # The job's vLLMs (the one killed, the one started again) and their engine processes
    # went with the job's worker: none holds its memory on.
    left = []
    for pid in vllm_processes() - before:
        with contextlib.suppress(psutil.NoSuchProcess):
            left.append(psutil.Process(pid))
    _, alive = psutil.wait_procs(left, timeout=60)
    assert alive == []
    assert sorted(line["custom_id"] for line in output) == sorted(r["custom_id"] for r in lines)
    codec = PromptCodec(str(bos_llm))
    by_id = {line["custom_id"]: line["response"]["body"] for line in output}
    for request in lines:
        chat = request["body"]["messages"]
        own = vllm_server.post(
            "/chat/completions", {"messages": chat, "max_tokens": MAX_TOKENS, "temperature": 0}
        )
        body = by_id[request["custom_id"]]
        assert body["choices"][0]["message"]["content"] == own["choices"][0]["message"]["content"]
        assert body["usage"]["prompt_tokens"] == len(codec.encode(chat))
        assert body["usage"]["prompt_tokens"] == own["usage"]["prompt_tokens"]
