"""LoRA adapters by name: --lora-modules at start, POST /v1/load_lora_adapter and
/v1/unload_lora_adapter at run time (with --allow-runtime-lora-updating, behind --api-key as all
of /v1/), and the `model` field of a request picking one. Adapters are read and checked off the
event loop; a bad one is a 400 naming the file and what is wrong. Unloading forgets the name and
drops the adapter's cached K/V (LLMEngine.remove_lora, on the engine's thread): requests already
running finish on the weights they started with."""

from __future__ import annotations

import asyncio
import itertools
import reprlib
import threading
from concurrent.futures import Future

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from kvserve.lora.adapter import AdapterError
from kvserve.lora.request import MAX_LORA_NAME_CHARS, LoRARequest
from kvserve.server.errors import APIError

MAX_PATH_CHARS = 4096
READERS = 2  # adapters read at once
READ_TIMEOUT_S = 120.0


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    lora_name: str
    lora_int_id: int | None = None


class LoRAModules:
    """The server's adapter names -> LoRARequests (ids given in order of loading)."""

    def __init__(self, engine, base_names: tuple[str, ...], on_unload=None, on_engine=None, on_load=None) -> None:
        self.engine = engine
        self.on_load = on_load  # called with each LoRARequest named (its metrics series may be made)
        self.on_engine = on_engine  # AsyncEngine.call: runs a function on the engine's thread between steps
        self.on_unload = on_unload  # called with the name of each adapter unloaded (its metrics series go)
        self.base_names = base_names
        self._ids = itertools.count(1)
        self._by_name: dict[str, LoRARequest] = {}
        self._loading: set[str] = set()  # names whose adapter is being read: a second load of one is refused at once
        self._lock = threading.Lock()
        # adapters are read in daemon threads of their own, never in the event loop's shared pool: a path that
        # blocks (a stalled mount) holds one of READERS threads, not the tokenizer's or the template's, nor the exit
        self._reading = threading.BoundedSemaphore(READERS)

    @property
    def names(self) -> list[str]:
        return list(self._by_name)

    def request_for(self, model: str) -> LoRARequest | None:
        return self._by_name.get(model)

    def load(self, name: str, path: str) -> LoRARequest:
        """Read, check and name an adapter (blocking: call it off the event loop)."""
        if self.engine.lora is None:
            raise APIError(400, "this server serves no LoRA adapters: start it with --enable-lora", "lora_name")
        if not 1 <= len(name) <= MAX_LORA_NAME_CHARS or not name.isprintable() or any(c in name for c in ',"\\'):
            raise APIError(400, f"lora_name must be 1 to {MAX_LORA_NAME_CHARS} printable characters without commas, quotes or "
                           "backslashes", "lora_name")  # fmt: skip
        if not 1 <= len(path) <= MAX_PATH_CHARS or "\x00" in path:
            raise APIError(400, f"lora_path must be a directory path of at most {MAX_PATH_CHARS} characters", "lora_path")
        with self._lock:
            if name in self.base_names or name in self._by_name or name in self._loading:
                raise APIError(400, f"lora_name {reprlib.repr(name)} is already served", "lora_name")
            self._loading.add(name)
            request = LoRARequest(name, next(self._ids), path)
        try:
            self.engine.lora.resolve(request, pin=True)
        except AdapterError as exc:
            raise APIError(400, str(exc), "lora_path") from None
        finally:
            with self._lock:
                self._loading.discard(name)
        with self._lock:
            self._by_name[name] = request
        if self.on_load is not None:
            self.on_load(request)
        return request

    async def load_async(self, name: str, path: str) -> LoRARequest:
        """load() in this server's adapter readers, within READ_TIMEOUT_S; when every reader is busy
        (paths that block), a 503 at once."""
        if not self._reading.acquire(blocking=False):
            raise APIError(503, "every LoRA adapter reader is busy (paths that do not answer?); retry later", "lora_path",
                           "server_overloaded", "lora_readers_busy", {"Retry-After": "5"})  # fmt: skip
        future: Future = Future()

        def read() -> None:
            try:
                future.set_result(self.load(name, path))
            except BaseException as exc:  # noqa: BLE001 - the awaiting handler raises it
                future.set_exception(exc)
            finally:
                self._reading.release()

        threading.Thread(target=read, name="kvserve-lora-read", daemon=True).start()
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), READ_TIMEOUT_S)
        except TimeoutError:
            raise APIError(400, f"lora_path {reprlib.repr(path)} did not finish reading within {READ_TIMEOUT_S:g} s", "lora_path") from None

    async def unload(self, name: str) -> None:
        with self._lock:
            request = self._by_name.pop(name, None)
        if request is None:
            raise APIError(404, f"no LoRA adapter named {reprlib.repr(name)} is loaded", "lora_name", "not_found_error", "lora_not_found")
        await self.on_engine(lambda: self.engine.remove_lora(request.lora_int_id))
        if self.on_unload is not None:
            self.on_unload(name)


def register_routes(app: FastAPI, serving) -> None:
    modules: LoRAModules = serving.lora_modules
    if not serving.config.allow_runtime_lora_updating:
        return

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        request = await modules.load_async(body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        await modules.unload(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
