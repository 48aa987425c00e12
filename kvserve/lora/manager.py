"""The adapters an engine holds: each request's adapter read and checked when the request arrives
(a bad adapter fails the request before any work), up to max_cpu_loras kept as read (float32, LRU)
and up to max_loras resident as products in the activations' dtype (LRU), made again on demand.
A step with more distinct adapters than max_loras holds them all for that step."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.lora.adapter import LoRAAdapter, adapter_bytes, load_adapter
from kvserve.lora.request import LoRARequest
from kvserve.lora.rows import LoRARows, ResidentAdapter
from kvserve.model.config import ModelConfig


@dataclass(frozen=True, eq=False)
class LoRAHandle:
    """A request's adapter: what it asked for and the weights it runs with to its end."""

    request: LoRARequest
    adapter: LoRAAdapter

    @property
    def identity(self) -> str:
        return self.adapter.identity


MAX_SEEN = 4096


class LoRAManager:
    def __init__(self, model: ModelConfig, max_loras: int, max_lora_rank: int, max_cpu_loras: int, dtype: torch.dtype,
                 device: torch.device, native: bool) -> None:  # fmt: skip
        self.model = model
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.dtype, self.device, self.native = dtype, device, native
        self._read: OrderedDict[int, LoRAHandle] = OrderedDict()  # lora_int_id -> handle, LRU
        self._pinned: dict[int, LoRAHandle] = {}  # the server's named adapters: never read again until forgotten
        self._resident: OrderedDict[str, ResidentAdapter] = OrderedDict()  # identity -> products, LRU
        self._lock = threading.Lock()  # the server loads adapters off the engine's thread
        self._last: tuple[np.ndarray, list[ResidentAdapter], LoRARows | None] | None = None  # decode steps repeat their layout
        self._seen: OrderedDict[int, str] = OrderedDict()  # lora_int_id -> identity of every adapter read (bounded): remove_lora

    def resolve(self, request: LoRARequest, pin: bool = False) -> LoRAHandle:
        """The handle of a request's adapter, read from its directory unless held (AdapterError if bad).
        pin: keep it outside the LRU (the server's named adapters) until forget()."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a kvserve.LoRARequest, got {type(request).__name__}")
        with self._lock:
            held = self._pinned.get(request.lora_int_id) or self._read.get(request.lora_int_id)
            if held is not None:
                if (held.request.lora_name, held.request.lora_path) != (request.lora_name, request.lora_path):
                    raise ValueError(f"lora_int_id {request.lora_int_id} is adapter {held.request.lora_name!r} at "
                                     f"{held.request.lora_path}; {request.lora_name!r} at {request.lora_path} needs another id")  # fmt: skip
                if request.lora_int_id in self._read:
                    self._read.move_to_end(request.lora_int_id)
                return held
        handle = LoRAHandle(request, load_adapter(request.lora_path, self.model, self.max_lora_rank))
        with self._lock:
            self._seen[request.lora_int_id] = handle.identity
            self._seen.move_to_end(request.lora_int_id)
            if len(self._seen) > MAX_SEEN:
                self._seen.popitem(last=False)
            if pin:
                self._pinned[request.lora_int_id] = handle
                return handle
            self._read[request.lora_int_id] = handle
            while len(self._read) > self.max_cpu_loras:
                self._read.popitem(last=False)
        return handle

    def forget(self, lora_int_id: int) -> str | None:
        """Drop an adapter (running requests keep their handle's weights), held or read before; returns
        its identity when no other held id has the same weights (its cached K/V can go), else None."""
        with self._lock:
            self._pinned.pop(lora_int_id, None)
            self._read.pop(lora_int_id, None)
            identity = self._seen.pop(lora_int_id, None)
            if identity is None or any(h.identity == identity for h in (*self._pinned.values(), *self._read.values())):
                return None
            self._resident.pop(identity, None)  # made again if a running request still needs it
            return identity

    def names(self, identity: str) -> list[str]:
        """The names of the held adapters with these weights."""
        with self._lock:
            return sorted({h.request.lora_name for h in (*self._pinned.values(), *self._read.values()) if h.identity == identity})

    def knows(self, lora_int_id: int) -> bool:
        """Held, or read before (and not forgotten)."""
        with self._lock:
            return lora_int_id in self._seen

    @property
    def max_resident_bytes(self) -> int:
        """What max_loras adapters of max_lora_rank on every projection hold at most (kvserve plan's lora_bytes)."""
        return self.max_loras * adapter_bytes(self.model, self.max_lora_rank, torch.empty((), dtype=self.dtype).element_size())

    @property
    def resident_bytes(self) -> int:
        return sum(r.nbytes for r in self._resident.values())

    def rows(self, handles: list[LoRAHandle | None]) -> LoRARows | None:
        """The step's LoRARows for rows using these adapters (None: no adapter)."""
        slots = np.full(len(handles), -1, dtype=np.int64)
        adapters: list[ResidentAdapter] = []
        index: dict[str, int] = {}
        for row, handle in enumerate(handles):
            if handle is None:
                continue
            slot = index.get(handle.identity)
            if slot is None:
                slot = index[handle.identity] = len(adapters)
                adapters.append(self._resident_for(handle))
            slots[row] = slot
        if adapters:
            while len(self._resident) > max(self.max_loras, len(adapters)):
                self._resident.popitem(last=False)
        last = self._last
        if last is not None and len(last[1]) == len(adapters) and all(a is b for a, b in zip(last[1], adapters)) and np.array_equal(last[0], slots):
            return last[2]
        rows = LoRARows.of(slots, adapters, self.device)
        self._last = (slots, adapters, rows)
        return rows

    def _resident_for(self, handle: LoRAHandle) -> ResidentAdapter:
        resident = self._resident.get(handle.identity)
        if resident is None:
            resident = ResidentAdapter(handle.adapter, self.model, self.dtype, self.device)
            self._resident[handle.identity] = resident
        self._resident.move_to_end(handle.identity)
        return resident
