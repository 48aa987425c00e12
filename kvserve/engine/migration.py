"""A running request's state as it moves to another engine (live migration).

What continues a request exactly elsewhere: its prompt and the tokens generated so far, its
sampling parameters and seed (a draw depends on the seed and the token's position alone, so the
count of draws is the number of tokens), its logprobs so far, and the KV of its full blocks as
self-checking block records (kv/tiers/record.py) when no shared remote tier carries them. The
target recomputes what no record covers (the last, partial block at least); by the invariance
contract those tokens get the same bits as at the source.

Wire format: a 4-byte little-endian length, the JSON state, then each record as a 4-byte length
and its bytes.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from dataclasses import dataclass

from kvserve.engine.sequence import TokenLogprobs
from kvserve.kv.tiers.record import record_overhead
from kvserve.sampling_params import SamplingParams
from kvserve.structured.spec import StructuredOutputs

FORMAT_VERSION = 1
_LENGTH = struct.Struct("<I")
MAX_STATE_BYTES = 64 << 20  # the JSON part: token ids, parameters, logprobs


@dataclass(frozen=True)
class RequestState:
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    seed: int
    identity: int  # the cache identity's root hash: the target must have the same model and KV settings
    cache_salt: str | None = None
    prompt: str | None = None
    stream: bool = False
    logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)
    num_cached_tokens: int = 0
    records: list[bytes] = dataclasses.field(default_factory=list)

    def to_bytes(self) -> bytes:
        state = {
            "version": FORMAT_VERSION, "prompt_token_ids": self.prompt_token_ids, "output_token_ids": self.output_token_ids,
            "params": dataclasses.asdict(self.params), "seed": self.seed, "identity": f"{self.identity:032x}",
            "cache_salt": self.cache_salt, "prompt": self.prompt, "stream": self.stream, "num_cached_tokens": self.num_cached_tokens,
            "logprobs": [[lp.token_id, lp.logprob, [[t, v] for t, v in lp.top.items()]] for lp in self.logprobs],
        }  # fmt: skip
        head = json.dumps(state).encode()
        return b"".join([_LENGTH.pack(len(head)), head, *(_LENGTH.pack(len(r)) + r for r in self.records)])

    @classmethod
    def from_bytes(cls, data: bytes) -> "RequestState":
        """The state in data; ValueError naming what is wrong with it."""
        view = memoryview(data)
        if len(view) < _LENGTH.size:
            raise ValueError("migration state: shorter than its header")
        (size,) = _LENGTH.unpack_from(view)
        if size > MAX_STATE_BYTES or _LENGTH.size + size > len(view):
            raise ValueError("migration state: its JSON part is truncated or too large")
        try:
            state = json.loads(bytes(view[_LENGTH.size : _LENGTH.size + size]))
        except (ValueError, UnicodeDecodeError, RecursionError) as error:
            raise ValueError(f"migration state: not JSON ({error})") from None
        if not isinstance(state, dict) or state.get("version") != FORMAT_VERSION:
            raise ValueError(f"migration state: not a version-{FORMAT_VERSION} kvserve request state")
        records, offset = [], _LENGTH.size + size
        while offset < len(view):
            if offset + _LENGTH.size > len(view):
                raise ValueError("migration state: a record's length is truncated")
            (length,) = _LENGTH.unpack_from(view, offset)
            offset += _LENGTH.size
            if offset + length > len(view):
                raise ValueError("migration state: a record is truncated")
            if length < record_overhead(0):
                raise ValueError("migration state: a record is shorter than a record's header")
            records.append(bytes(view[offset : offset + length]))
            offset += length
        try:
            return cls._from_json(state, records)
        except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as error:
            message = str(error) if isinstance(error, ValueError) else f"a field is missing or of the wrong type ({type(error).__name__})"
            raise ValueError(f"migration state: {message}") from None

    @classmethod
    def _from_json(cls, state: dict, records: list[bytes]) -> "RequestState":
        tokens = [_token_list(state, name) for name in ("prompt_token_ids", "output_token_ids")]
        params = state["params"]
        if not isinstance(params, dict):
            raise ValueError("params must be an object of sampling parameters")
        params = {k: v for k, v in params.items() if k in _PARAM_FIELDS}
        if params.get("structured_outputs") is not None:
            structured = params["structured_outputs"]
            if not isinstance(structured, dict):
                raise ValueError("structured_outputs must be an object")
            params["structured_outputs"] = StructuredOutputs(**{k: v for k, v in structured.items() if k in _STRUCTURED_FIELDS})
        params = SamplingParams(**params)
        seed, cached, identity = state["seed"], state.get("num_cached_tokens", 0), state["identity"]
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**64:
            raise ValueError("seed must be an unsigned 64-bit integer")
        if not isinstance(cached, int) or isinstance(cached, bool) or not 0 <= cached <= len(tokens[0]):
            raise ValueError("num_cached_tokens must count prompt tokens")
        if not isinstance(identity, str) or len(identity) != 32 or any(c not in "0123456789abcdef" for c in identity):
            raise ValueError("identity must be 32 hex digits")
        salt, prompt, stream = state.get("cache_salt"), state.get("prompt"), state.get("stream", False)
        if not (salt is None or isinstance(salt, str)) or not (prompt is None or isinstance(prompt, str)):
            raise ValueError("cache_salt and prompt must be strings or null")
        if not isinstance(stream, bool):
            raise ValueError("stream must be true or false")
        logprobs = state.get("logprobs", [])
        if not isinstance(logprobs, list) or not all(_is_logprob(entry) for entry in logprobs):
            raise ValueError("logprobs must be a list of [token id, logprob, [[token id, logprob], ...]]")
        logprobs = [TokenLogprobs(t, float(lp), {k: float(v) for k, v in top}) for t, lp, top in logprobs]
        return cls(tokens[0], tokens[1], params, seed, int(identity, 16), salt, prompt, stream, logprobs, cached, records)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_token(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_logprob(entry) -> bool:
    return (isinstance(entry, list) and len(entry) == 3 and _is_token(entry[0]) and _is_number(entry[1]) and isinstance(entry[2], list)
            and all(isinstance(p, list) and len(p) == 2 and _is_token(p[0]) and _is_number(p[1]) for p in entry[2]))  # fmt: skip


_PARAM_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
_STRUCTURED_FIELDS = {f.name for f in dataclasses.fields(StructuredOutputs)}


def _token_list(state: dict, name: str) -> list[int]:
    tokens = state[name]
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
        raise ValueError(f"{name} must be a list of token ids")
    return tokens
