"""Live migration between servers: POST /v1/kv/migrate at the source, POST /v1/kv/import at the target.

The source takes the request's samples out of its engine between two steps (engine/migration.py:
token ids, parameters, seed, logprobs, and the KV of their cached blocks unless a shared remote tier
holds them) and posts each to the target's /v1/kv/import. The target continues the sample and
answers with its outputs as JSON lines; the source puts them into the request's queue, so the
client's open response (streamed or not) goes on as if nothing had happened and holds the tokens it
would have held. Whatever fails (the target refuses, is unreachable, or its stream breaks), the
sample goes back into the source's engine with every token relayed so far and finishes there; its
blocks are still in the source's prefix cache.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time

import httpx

from kvserve.engine.migration import RequestState
from kvserve.engine.sequence import TokenLogprobs
from kvserve.outputs import RequestOutput
from kvserve.server.async_engine import RequestAborted, Submission

log = logging.getLogger(__name__)

MIGRATE_PATH = "/v1/kv/migrate"
IMPORT_PATH = "/v1/kv/import"
MIGRATION_KEY_HEADER = "x-kvserve-migration-key"
_CONNECT_TIMEOUT_S = 5.0


class MigrationFailed(Exception):
    pass


def output_line(out: RequestOutput) -> str:
    """One output of an imported request, as the target streams it."""
    return json.dumps({
        "token_ids": out.token_ids, "text": out.text, "finished": out.finished, "finish_reason": out.finish_reason,
        "stop_reason": out.stop_reason, "num_output_tokens": out.num_output_tokens, "error": out.error,
        "logprobs": None if out.logprobs is None else [[lp.token_id, lp.logprob, list(lp.top.items())] for lp in out.logprobs],
    }) + "\n"  # fmt: skip


def error_line(error: RequestAborted) -> str:
    return json.dumps({"aborted": error.reason, "message": error.message}) + "\n"


def relayed_output(line: dict, request_id: str, state: RequestState, times: dict[str, float]) -> RequestOutput:
    """A target's output line as the source's engine would have made it."""
    logprobs = line.get("logprobs")
    if logprobs is not None:
        logprobs = [TokenLogprobs(int(t), float(lp), {int(k): float(v) for k, v in top}) for t, lp, top in logprobs]
    metrics = dict(times)
    if line["finished"]:
        metrics["last_token_time"] = metrics["finished_time"] = time.monotonic()
    return RequestOutput(
        request_id=request_id, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids, token_ids=list(line["token_ids"]),
        text=line["text"], finished=bool(line["finished"]), finish_reason=line.get("finish_reason"),
        stop_reason=line.get("stop_reason"), logprobs=logprobs, num_cached_tokens=state.num_cached_tokens, metrics=metrics,
        num_output_tokens=int(line["num_output_tokens"]), delta=state.stream, error=line.get("error"),
    )  # fmt: skip


class Migrator:
    """The source's side: take samples out, hand them to a target, relay its outputs in."""

    def __init__(self, server, targets: tuple[str, ...]) -> None:
        self.server = server
        self.targets = targets
        self._client: httpx.AsyncClient | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=_CONNECT_TIMEOUT_S))
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    def _headers(self) -> dict[str, str]:
        config = self.server.config
        headers = {"content-type": "application/octet-stream", MIGRATION_KEY_HEADER: config.migration_key or ""}
        if config.api_key:
            headers["authorization"] = f"Bearer {config.api_key}"
        return headers

    async def migrate(self, sub: Submission, target: str) -> int:
        """Move the request's unfinished samples to target; returns how many moved. Raises
        MigrationFailed (the samples go on here) or ValueError (they cannot move)."""
        async_engine, engine = self.server.async_engine, self.server.engine
        offloader = engine.kv.offloader
        with_records = offloader is None or not offloader.writes_remote

        def take_out() -> list[tuple[str, RequestState, dict]]:
            taken = []
            try:
                for rid in sorted(sub.unfinished):
                    seq = engine.requests.get(rid)
                    if seq is None:
                        continue
                    times = {"arrival_time": seq.arrival_time}
                    for name in ("first_scheduled_time", "first_token_time"):
                        if getattr(seq, name) is not None:
                            times[name] = getattr(seq, name)
                    taken.append((rid, engine.export_request(rid, with_records), times))
                    async_engine.detach(rid)
            except Exception:
                for rid, state, _ in taken:
                    self._resume(sub, rid, state)
                raise
            return taken

        taken = await async_engine.call(take_out)
        if not taken:
            raise ValueError("the request has no sample left running to migrate")
        opened = []
        try:
            for rid, state, times in taken:
                opened.append((rid, state, times, await self._open(target, state)))
        except MigrationFailed:
            for _, _, _, response in opened:
                await response.aclose()
            await async_engine.call(lambda: [self._resume(sub, rid, state) for rid, state, _ in taken])
            engine.migrations["failed"] += len(taken)
            raise
        for rid, state, times, response in opened:
            task = asyncio.ensure_future(self._relay(sub, rid, state, times, response))
            sub.relays.add(task)
            task.add_done_callback(sub.relays.discard)
        return len(taken)

    async def _open(self, target: str, state: RequestState) -> httpx.Response:
        body = await asyncio.to_thread(state.to_bytes)
        try:
            request = self.client.build_request("POST", target + IMPORT_PATH, content=body, headers=self._headers())
            response = await self.client.send(request, stream=True)
        except httpx.HTTPError as error:
            raise MigrationFailed(f"the target {target} did not answer ({type(error).__name__}: {error})") from None
        if response.status_code != 200:
            detail = (await response.aread())[:500].decode(errors="replace")
            await response.aclose()
            raise MigrationFailed(f"the target {target} refused the request ({response.status_code}: {detail})")
        return response

    async def _relay(self, sub: Submission, rid: str, state: RequestState, times: dict, response: httpx.Response) -> None:
        tokens: list[int] = []
        logprobs: list[TokenLogprobs] = []
        try:
            async for text in response.aiter_lines():
                if not text.strip():
                    continue
                line = json.loads(text)
                if "aborted" in line:
                    raise MigrationFailed(f"the target aborted it ({line['aborted']}: {line.get('message')})")
                out = relayed_output(line, rid, state, times)
                if out.finished:
                    self.server.metrics.observe_finished(out)
                sub.sink.put_nowait(out)
                if out.finished:
                    return
                tokens += out.token_ids
                logprobs += out.logprobs or []
            raise MigrationFailed("the target's stream ended before the request finished")
        except asyncio.CancelledError:
            raise
        except (httpx.HTTPError, MigrationFailed, ValueError, KeyError, TypeError) as error:
            log.warning("migrating %s failed after %d relayed tokens (%s); it finishes here", sub.request_id, len(tokens), error)
            self.server.engine.migrations["failed"] += 1
            resumed = dataclasses.replace(state, output_token_ids=[*state.output_token_ids, *tokens],
                                          logprobs=[*state.logprobs, *logprobs] if state.params.logprobs is not None else [],
                                          records=[])  # fmt: skip
            try:
                await self.server.async_engine.call(lambda: self._resume(sub, rid, resumed))
            except Exception as exc:  # noqa: BLE001 - it cannot go on anywhere: the client hears why
                sub.fail(RequestAborted("migration_failed", f"the request could not continue after a failed migration ({exc})", 502))
        finally:
            await response.aclose()

    def _resume(self, sub: Submission, rid: str, state: RequestState) -> None:
        """Engine thread: the sample continues in this engine, its outputs to its request again."""
        self.server.engine.import_request(state, rid, returning=True)
        self.server.async_engine.attach(rid, sub)
