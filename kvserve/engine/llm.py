"""The offline entry point: LLM(...).generate(prompts, params)."""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Sequence as Seq

from tqdm import tqdm

from kvserve.lora.request import LoRARequest
from kvserve.config import EngineConfig
from kvserve.engine.beam import BeamSearchOutput, BeamSearchParams
from kvserve.engine.conversation_prefix import earlier_turns, shared_length
from kvserve.engine.engine import LLMEngine
from kvserve.engine.migration import RequestState
from kvserve.model.registry import DEFAULT_MODEL
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams

PromptType = str | list[int]


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **engine_args) -> None:
        unknown = set(engine_args) - EngineConfig.field_names()
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        llm = cls.__new__(cls)
        llm.engine = LLMEngine(config)
        return llm

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        """The model's tokenizer (vLLM's LLM.get_tokenizer): encode, decode, and transformers'
        apply_chat_template(conversation, tools=..., add_generation_prompt=..., tokenize=..., return_dict=...)."""
        return self.engine.tokenizer

    def chat(
        self,
        messages: Seq[dict] | Seq[Seq[dict]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """vLLM's LLM.chat: one conversation (a list of {"role", "content"} messages) or a list of them,
        rendered by the model's chat template (or `chat_template`) and generated like generate()."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of messages, or a list of such lists")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        try:
            json.dumps(conversations, ensure_ascii=False, default=str).encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("messages hold an unpaired surrogate (\\ud800-\\udfff): not valid Unicode text") from None
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat needs the model's tokenizer (this engine runs on token ids only)")
        render = functools.partial(tokenizer.apply_chat_template, tools=tools, chat_template=chat_template)
        prompts = [render(list(c), add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message)
                   for c in conversations]  # fmt: skip
        sampling_params = SamplingParams() if sampling_params is None else sampling_params
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) == len(prompts):  # else generate says why
            params = [self._sparing_earlier_turns(p, c, ids, render) for p, c, ids in zip(params, conversations, prompts)]
        return self.generate(prompts, params, use_tqdm=use_tqdm, cache_salt=cache_salt, lora_request=lora_request)

    def _sparing_earlier_turns(self, params: SamplingParams, conversation, ids: list[int], render) -> SamplingParams:
        """A compressing request leaves its conversation's earlier turns whole (engine/conversation_prefix.py)."""
        if not isinstance(params, SamplingParams) or params.kv_compress_from is not None or self.engine.eviction_policy(params) is None:
            return params
        earlier = earlier_turns(conversation)
        shared = shared_length(render(earlier, add_generation_prompt=False), ids) if earlier else 0
        return dataclasses.replace(params, kv_compress_from=shared)

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        cache_salt: str | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt; one output per prompt and sample (n of them in a row for
        SamplingParams(n=...)), in order. Requests with different `cache_salt`s never share
        prefix-cache blocks. lora_request: one adapter for every prompt, or one per prompt (None: the
        base model), on an engine with enable_lora."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        engine = self.engine
        # validate everything before queueing anything, so a bad prompt leaves no orphans behind
        for prompt in prompts:
            if isinstance(prompt, str):
                if not prompt:
                    raise ValueError("prompt must not be empty")
            else:
                engine.validate_prompt_tokens(prompt)
        for sp in set(params):
            engine.eviction_policy(sp)
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora_requests for {len(prompts)} prompts")
        for lora in {id(r): r for r in loras if r is not None}.values():
            engine._lora_handle(lora)  # a bad adapter fails here, before anything is queued
        seqs = [seq for p, sp, lora in zip(prompts, params, loras)
                for seq in engine.add_request_group(p, sp.samples(), cache_salt=cache_salt, lora_request=lora)]  # fmt: skip
        progress = tqdm(total=len(seqs), desc="generate", unit="req", disable=not use_tqdm or len(seqs) < 2)
        tokens_before = engine.generation_tokens_total

        def shown(out: RequestOutput) -> None:
            progress.set_postfix(gen_tok=engine.generation_tokens_total - tokens_before, refresh=False)

        results = self._run_until_finished([s.request_id for s in seqs], progress, shown)
        return [results[s.request_id] for s in seqs]

    def _run_until_finished(self, request_ids: list[str], progress: tqdm, seen=None) -> dict[str, RequestOutput]:
        """Step the engine until every one of request_ids has its finished output (`seen` is called with
        each, and may raise); on any exception the unfinished ones are aborted, leaving no orphans."""
        wanted, results = set(request_ids), {}
        try:
            while len(results) < len(wanted):
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        results[out.request_id] = out
                        progress.update(1)
                        if seen is not None:
                            seen(out)
        except BaseException:
            for request_id in wanted - set(results):
                self.engine.abort_request(request_id)
            raise
        finally:
            progress.close()
        return results

    def beam_search(self, prompts: PromptType | dict | Seq[PromptType | dict], params: BeamSearchParams,
                    use_tqdm: bool = False, cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None) -> list[BeamSearchOutput]:  # fmt: skip
        """Beam search of every prompt (a string, token ids, or vLLM's {"prompt": ...} / {"prompt_token_ids": ...}):
        one BeamSearchOutput each, its beam_width finished beams best first, as transformers'
        generate(num_beams=beam_width) orders them. The beams share their prefix blocks. lora_request:
        the adapter every beam runs on (engine with enable_lora)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = [_prompt_of(p) for p in prompts]
        engine = self.engine
        for prompt in prompts:
            if not isinstance(prompt, str):
                engine.validate_prompt_tokens(prompt)
            elif not prompt:
                raise ValueError("prompt must not be empty")
        groups = []
        try:
            for prompt in prompts:
                groups.append(engine.add_beam_search(prompt, params, cache_salt=cache_salt, lora_request=lora_request))
        except BaseException:  # one the pool cannot hold: the ones queued before it go too
            for group in groups:
                engine.abort_request(group.request_id)
            raise
        progress = tqdm(total=len(groups), desc="beam search", unit="prompt", disable=not use_tqdm or len(groups) < 2)

        def failed(out: RequestOutput) -> None:
            if out.error:
                raise RuntimeError(f"beam search of {out.request_id} failed: {out.error}")

        results = self._run_until_finished([g.request_id for g in groups], progress, failed)
        return [results[g.request_id].beams for g in groups]

    def export_request(self, request_id: str, with_records: bool = True) -> RequestState:
        """A queued or running request's state (live migration), after which it leaves this engine;
        see LLMEngine.export_request. Requests are queued and stepped with llm.engine.add_request
        and llm.engine.step()."""
        return self.engine.export_request(request_id, with_records)

    def import_request(self, state: RequestState) -> RequestOutput:
        """Continue an exported request here to its end; its finished output (all its tokens). It steps
        the engine as generate() does: outputs of requests queued with llm.engine.add_request finish
        unseen; to keep them, call llm.engine.import_request and step the engine yourself."""
        seq = self.engine.import_request(state)
        seq.stream = False
        while True:
            for out in self.engine.step():
                if out.request_id == seq.request_id and out.finished:
                    return out

    def stats(self) -> dict:
        return self.engine.stats()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix; returns how many blocks were forgotten."""
        return self.engine.reset_prefix_cache()


def _prompt_of(prompt: PromptType | dict) -> PromptType:
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"]
        raise ValueError(f"a prompt dict takes \"prompt\" or \"prompt_token_ids\", got keys {sorted(prompt)}")
    return prompt
