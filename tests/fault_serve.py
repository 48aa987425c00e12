"""`kvserve` with a test-only step hook (LLMEngine.step_fault_hook), chosen by token ids in a prompt:
a step whose batch holds POISON raises RuntimeError (that step fails), FATAL raises a BaseException
(the engine thread dies), SLOW sleeps 50 ms (a request that takes as long as a test needs)."""

import sys
import time

from kvserve.cli import main
from kvserve.engine.engine import LLMEngine

POISON, FATAL, SLOW = 477, 478, 479


class EngineKilled(BaseException):
    pass


def hook(batch) -> None:
    prompts = [seq.prompt_token_ids for seq, _ in batch.entries]
    if any(FATAL in p for p in prompts):
        raise EngineKilled("injected fatal fault")
    if any(POISON in p for p in prompts):
        raise RuntimeError("injected step fault")
    if any(SLOW in p for p in prompts):
        time.sleep(0.05)


if __name__ == "__main__":
    LLMEngine.step_fault_hook = staticmethod(hook)
    sys.exit(main())
