"""Benchmark 20: a hostile client against two gateway replicas.

Two replicas of the Batch API gateway serve one set of records on the embedded stack (2
workers, the tiny model of the gateway's tests). Each round, through both replicas:
- batch files of 200 requests from `tests/gateway/hostile.py`: a third of the requests out
  of range (numbers past a float or an int64, lone surrogates, unknown models, tools,
  streams), and one file in three holding lines no parser should take (NaN, Infinity,
  nesting 200,000 deep, a line past `max_line_bytes`, gzip and binary bytes, a lone
  surrogate in a custom_id); uploaded with the official `openai` client, one cancelled as
  it is created, one whose input file is deleted as its batch is created;
- raw HTTP probes (bodies not JSON, not UTF-8, nested past any parser, cut short, 2 MB;
  wrong content types; multipart bodies that do not parse, form fields of 100 kB; ids of
  another owner; request lines and headers past the HTTP parser's limits);
- twenty batch creates and eight uploads at once by a key whose quota is one batch and
  64 KiB;
- one replica SIGKILLed at a random moment, then started again.

Every replica's resident memory is sampled every 20 ms throughout. At the end every batch
is waited for and checked: each request of a batch that ran in its output or error file
exactly once, each refusal with the API's error envelope.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import yaml

from .common import REPO, Context, Section, ebb_stack, table

KEYS = {"alice": "sk-alice-0123456789", "bob": "sk-bob-0123456789"}
BOB_BATCHES, BOB_BYTES = 1, 64 * 1024
MAX_LINE_BYTES = 256 * 1024


def _config(ctx: Context, model_dir: Path) -> Path:
    config = {
        "root": str(ctx.dir("hostile") / "root"),
        "models": {
            "tiny-chat": {
                "stage": {
                    "llm": {
                        "model": str(model_dir),
                        "max_in_flight": 16,
                        "sampling": {"max_tokens": 4, "temperature": 0.0},
                    },
                    "batch_size": 32,
                },
                "resources": {"max_workers": 2},
                "rows_per_shard": 50,
            }
        },
        "keys": [
            {"owner": "alice", "key": KEYS["alice"], "max_active_batches": 100},
            {
                "owner": "bob",
                "key": KEYS["bob"],
                "max_active_batches": BOB_BATCHES,
                "max_stored_bytes": BOB_BYTES,
            },
        ],
        "max_file_bytes": 16 * 1024 * 1024,
        "max_line_bytes": MAX_LINE_BYTES,
    }
    path = ctx.dir("hostile") / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run(ctx: Context) -> Section:
    sys.path.insert(0, str(REPO))
    from tests.llm_model import build_tiny_llm

    model_dir = build_tiny_llm(
        ctx.dir("hostile") / "model", layers=2, hidden=64, vocab=2000, context=512
    )
    rounds = ctx.size(6, 2)
    config = _config(ctx, model_dir)
    found = asyncio.run(_campaign(ctx, config, rounds))
    rows = [
        ["rounds", f"{rounds}"],
        ["batch files (of them meant to fail)", f"{found['files']} ({found['failing']})"],
        ["requests in them (refusals among them)", f"{found['requests']:,} ({found['refused']:,})"],
        ["HTTP probes", f"{found['probes']:,}"],
        ["creates and uploads racing a quota", f"{found['races']:,}"],
        ["replicas SIGKILLed", f"{found['kills']}"],
        ["replica exits of their own", f"{found['exits']}"],
        ["5xx answers", f"{found['5xx']}"],
        ["refusals without the API's error shape", f"{found['shapeless']}"],
        ["requests not answered exactly once", f"{found['not_once']}"],
        ["batches that ended otherwise than their file calls for", f"{found['wrong_end']}"],
        ["most batches active at once for a quota of 1", f"{found['bob_active']}"],
        [f"most bytes stored for a quota of {BOB_BYTES:,}", f"{found['bob_bytes']:,}"],
        ["replica peak RSS", f"{found['rss_peak'] / 2**20:.0f} MiB"],
        ["replica RSS at start", f"{found['rss_start'] / 2**20:.0f} MiB"],
    ]
    return Section(
        title="20. A hostile client against two gateway replicas",
        intro=__doc__ or "",
        tables=[table(["", "measured"], rows)],
        notes=[
            "The bound stated for the suite's slice (tests/gateway/test_campaign.py) is 512 MiB "
            "a replica; a line is never held past `max_line_bytes` (256 KiB here, 1 MiB by "
            "default) nor a row group past 32 MiB of prompts, whatever the file.",
            "A request line or header past the HTTP parser's limits (8 kB) is answered by aiohttp "
            "before the API sees it: a plain 400, counted apart from the API's refusals.",
        ],
        summary={
            "exits": found["exits"],
            "5xx": found["5xx"],
            "not_once": found["not_once"],
            "rss_peak_mib": found["rss_peak"] / 2**20,
        },
        slug="hostile",
    )


async def _campaign(ctx: Context, config: Path, rounds: int) -> dict[str, Any]:
    import aiohttp
    import openai

    from tests.gateway.hostile import (
        assert_error_shape,
        batch_file,
        check_batch,
        http_probes,
        send,
    )

    rng = random.Random(20)
    counted = "files failing requests refused probes races kills exits 5xx shapeless"
    counted += " not_once wrong_end bob_active bob_bytes rss_peak rss_start"
    found: dict[str, Any] = dict.fromkeys(counted.split(), 0)
    async with ebb_stack(ctx, "hostile", max_workers=2, gateway=config, gateway_replicas=2) as (
        stack,
        _,
    ):
        names = list(stack.gateway_ports)
        bases = [f"http://127.0.0.1:{stack.gateway_ports[n]}/v1" for n in names]
        clients = [
            {o: openai.OpenAI(base_url=b, api_key=k, max_retries=0) for o, k in KEYS.items()}
            for b in bases
        ]
        found["rss_start"] = max(
            psutil.Process(stack.processes[n].pid).memory_info().rss for n in names
        )
        sampling = asyncio.create_task(_sample_rss(stack, names, found))
        made: list[tuple[Any, Any, str]] = []
        try:
            theirs = clients[0]["bob"].files.create(file=("b.jsonl", b"{}\n"), purpose="batch")
            their_batch = clients[0]["bob"].batches.create(
                input_file_id=theirs.id,
                endpoint="/v1/chat/completions",
                completion_window="24h",
            )
            others = {"file": theirs.id, "batch": their_batch.id}
            async with aiohttp.ClientSession() as http:
                for r in range(rounds):
                    victim = rng.choice(names)
                    kill_after = rng.uniform(0.5, 4.0)
                    killer = asyncio.create_task(_kill_later(stack, victim, kill_after, found))
                    files = [
                        batch_file(
                            rng,
                            n=200,
                            tag=f"r{r}f{k}",
                            fails=k % 3 == 2,
                            max_line_bytes=MAX_LINE_BYTES,
                        )
                        for k in range(6)
                    ]
                    creating = asyncio.create_task(_create(clients, files, made, r))
                    for i, probe in enumerate(http_probes(rng, others=others, n=300)):
                        try:
                            status, body = await send(http, bases[i % 2], probe, KEYS)
                        except aiohttp.ClientError:
                            continue  # the replica asked was the one killed: no answer
                        found["probes"] += 1
                        if status >= 500:
                            found["5xx"] += 1
                            ctx.log(
                                f"  5xx: {probe.method} {probe.path[:80]} {status} {body!r:.300}"
                            )
                        elif status >= 400 and probe.api_shape:
                            try:
                                assert_error_shape(body)
                            except AssertionError:
                                found["shapeless"] += 1
                    await _race_quota(bases, http, found)
                    await creating
                    await killer
                    found["kills"] += 1
                    await stack.restart(victim)
                    await stack.wait_for_gateway(victim)
                    found["files"] += len(files)
                    found["failing"] += sum(f.fails for f in files)
                    found["requests"] += sum(len(f.custom_ids) for f in files)
                    found["refused"] += sum(len(f.refused) for f in files)
                    ctx.log(f"  round {r + 1}/{rounds}: {len(made)} batches so far")
            for batch, fuzz, how in made:
                ended = await _ended(clients[0]["alice"], batch.id)
                try:
                    oa = clients[0]["alice"]
                    output = _lines(oa, ended.output_file_id)
                    errors = _lines(oa, ended.error_file_id)
                    if how == "input deleted" and ended.status == "failed":
                        continue  # its file went before it was read: failed, as it says
                    check_batch(ended, fuzz, output, errors)
                except AssertionError as e:
                    key = "not_once" if "exactly once" in str(e) else "wrong_end"
                    found[key] += 1
                    ctx.log(f"  batch {batch.id} ({how}): {e}")
            found["exits"] += sum(1 for n in names if stack.processes[n].returncode is not None)
        finally:
            sampling.cancel()
            await asyncio.gather(sampling, return_exceptions=True)
            for by_owner in clients:
                for oa in by_owner.values():
                    oa.close()
    return found


async def _create(
    clients: list[dict[str, Any]], files: list[Any], made: list[tuple[Any, Any, str]], r: int
) -> None:
    for k, fuzz in enumerate(files):
        for attempt in range(20):
            oa = clients[(k + attempt) % 2]["alice"]
            try:
                uploaded = await asyncio.to_thread(
                    oa.files.create, file=(f"{r}-{k}.jsonl", fuzz.payload), purpose="batch"
                )
                batch = await asyncio.to_thread(
                    oa.batches.create,
                    input_file_id=uploaded.id,
                    endpoint="/v1/chat/completions",
                    completion_window="24h",
                )
                break
            except Exception:  # the replica asked is being killed: ask the other
                await asyncio.sleep(0.2)
        else:
            raise RuntimeError("no replica took the batch")
        how = "plain"
        if k == 1:
            await asyncio.to_thread(oa.batches.cancel, batch.id)
            how = "cancelled"
        elif k == 3:
            await asyncio.to_thread(oa.files.delete, uploaded.id)
            how = "input deleted"
        made.append((batch, fuzz, how))


async def _race_quota(bases: list[str], http: Any, found: dict[str, Any]) -> None:
    """Twenty creates and eight uploads at once by bob, through both replicas."""
    import aiohttp

    headers = {"Authorization": f"Bearer {KEYS['bob']}"}
    files = (await _ask(http, bases, "GET", "/files", headers))["data"]
    if not files:
        return
    body = {
        "input_file_id": files[-1]["id"],
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
    }

    async def create(i: int) -> int:
        async with http.post(f"{bases[i % 2]}/batches", json=body, headers=headers) as answer:
            return int(answer.status)

    async def upload(i: int) -> None:
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", b"x" * (BOB_BYTES // 3), filename="q.jsonl")
        async with http.post(f"{bases[i % 2]}/files", data=form, headers=headers):
            pass

    answers = await asyncio.gather(
        *(create(i) for i in range(20)), *(upload(i) for i in range(8)), return_exceptions=True
    )
    found["races"] += 28
    # Its file is one of its own, so each batch made takes the one place until it ends.
    found["bob_active"] = max(found["bob_active"], answers[:20].count(200))
    batches = (await _ask(http, bases, "GET", "/batches?limit=100", headers))["data"]
    ended = ("completed", "failed", "expired", "cancelled")
    active = [b for b in batches if b["status"] not in ended]
    files = (await _ask(http, bases, "GET", "/files", headers))["data"]
    found["bob_bytes"] = max(found["bob_bytes"], sum(f["bytes"] for f in files))
    # The next round's race starts from one file and no batch.
    for b in active:
        await _ask(http, bases, "POST", f"/batches/{b['id']}/cancel", headers)
    for f in files[:-1]:
        await _ask(http, bases, "DELETE", f"/files/{f['id']}", headers)


async def _ask(http: Any, bases: list[str], method: str, path: str, headers: Any) -> Any:
    """One request, to whichever replica answers (the other may be down)."""
    import aiohttp

    for _ in range(50):
        for base in bases:
            try:
                async with http.request(method, base + path, headers=headers) as answer:
                    return await answer.json()
            except aiohttp.ClientConnectionError:
                continue
        await asyncio.sleep(0.2)
    raise RuntimeError(f"no replica answered {method} {path}")


async def _kill_later(stack: Any, name: str, after_s: float, found: dict[str, Any]) -> None:
    await asyncio.sleep(after_s)
    if stack.processes[name].returncode is not None:
        found["exits"] += 1  # it went of itself before its SIGKILL came
    await stack.kill(name)


async def _sample_rss(stack: Any, names: list[str], found: dict[str, Any]) -> None:
    while True:
        for name in names:
            process = stack.processes.get(name)
            if process is None or process.returncode is not None:
                continue
            try:
                found["rss_peak"] = max(
                    found["rss_peak"], psutil.Process(process.pid).memory_info().rss
                )
            except psutil.NoSuchProcess:
                pass
        await asyncio.sleep(0.02)


async def _ended(oa: Any, batch_id: str) -> Any:
    deadline = time.monotonic() + 900
    while True:
        batch = await asyncio.to_thread(oa.batches.retrieve, batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        if time.monotonic() > deadline:
            raise RuntimeError(f"batch {batch_id} still {batch.status}")
        await asyncio.sleep(0.5)


def _lines(oa: Any, file_id: str | None) -> list[dict[str, Any]]:
    import json

    if file_id is None:
        return []
    return [json.loads(line) for line in oa.files.content(file_id).text.splitlines()]
