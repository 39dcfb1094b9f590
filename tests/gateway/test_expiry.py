"""Files past their `expires_at` are removed, record and bytes; the others stay."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest

from ebb.common.messaging.natsconfig import NatsConfig
from ebb.gateway.config import ApiKey, CatalogueModel, GatewayConfig
from ebb.gateway.service import Gateway, GatewaySettings

from ..helpers import wait_until


async def test_an_upload_is_removed_once_it_expires(
    tmp_path: Path, nats_config: NatsConfig
) -> None:
    config = GatewayConfig(
        root=str(tmp_path / "gateway"),
        models={"m": CatalogueModel(stage={"llm": {"model": str(tmp_path / "model")}})},
        keys=[ApiKey(owner="team", key="sk-team")],
        file_expiry_s=1.0,
    )
    gateway = Gateway(
        GatewaySettings(nats=nats_config, config=config, port=0, poll_s=0.1, sweep_s=0.2)
    )
    serving = asyncio.create_task(gateway.run())
    oa: openai.OpenAI | None = None
    try:
        await asyncio.wait_for(gateway.serving.wait(), 30)
        oa = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key="sk-team")
        uploaded = await asyncio.to_thread(
            oa.files.create, file=("in.jsonl", b"{}\n"), purpose="batch"
        )
        assert uploaded.expires_at is not None
        assert uploaded.expires_at - uploaded.created_at == 1
        stored = tmp_path / "gateway" / "files" / "team" / uploaded.id
        assert stored.read_bytes() == b"{}\n"

        async def gone() -> bool:
            return not await asyncio.to_thread(lambda: list(oa.files.list()))

        await wait_until(gone, timeout=30, what="the expired file to be removed")
        assert not stored.exists()
    finally:
        if oa is not None:
            oa.close()
        gateway.request_stop()
        await serving


async def test_an_upload_and_a_batch_s_results_keep_what_the_client_asks(
    tmp_path: Path, nats_config: NatsConfig
) -> None:
    config = GatewayConfig(
        root=str(tmp_path / "gateway"),
        models={"m": CatalogueModel(stage={"llm": {"model": str(tmp_path / "model")}})},
        keys=[ApiKey(owner="team", key="sk-team")],
    )
    gateway = Gateway(GatewaySettings(nats=nats_config, config=config, port=0, poll_s=0.2))
    serving = asyncio.create_task(gateway.run())
    oa: openai.OpenAI | None = None
    try:
        await asyncio.wait_for(gateway.serving.wait(), 30)
        oa = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key="sk-team")
        line = b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}\n'
        uploaded = await asyncio.to_thread(
            oa.files.create,
            file=("in.jsonl", line),
            purpose="batch",
            expires_after={"anchor": "created_at", "seconds": 7200},
        )
        assert uploaded.expires_at is not None
        assert uploaded.expires_at - uploaded.created_at == 7200
        with pytest.raises(openai.BadRequestError) as bad:
            await asyncio.to_thread(
                oa.files.create,
                file=("in.jsonl", line),
                purpose="batch",
                expires_after={"anchor": "created_at", "seconds": 10},
            )
        assert bad.value.param == "expires_after.seconds"
        assert [f.id for f in await asyncio.to_thread(lambda: list(oa.files.list()))] == [
            uploaded.id
        ]
        # Its one request is refused (no model): the batch ends with an error file, kept an
        # hour as asked.
        batch = await asyncio.to_thread(
            oa.batches.create,
            input_file_id=uploaded.id,
            endpoint="/v1/completions",
            completion_window="24h",
            output_expires_after={"anchor": "created_at", "seconds": 3600},
        )

        async def ended() -> object:
            b = await asyncio.to_thread(oa.batches.retrieve, batch.id)
            return b if b.status == "completed" else None

        done = await wait_until(ended, timeout=30, what="the batch to end")
        assert done.error_file_id is not None and done.output_file_id is None
        errors = await asyncio.to_thread(oa.files.retrieve, done.error_file_id)
        assert errors.purpose == "batch_output"
        assert errors.expires_at is not None and errors.expires_at - errors.created_at == 3600
    finally:
        if oa is not None:
            oa.close()
        gateway.request_stop()
        await serving
