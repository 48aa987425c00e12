"""The perplexity a compressed cache could reach at best: SnapKV scored by the scored text itself.

`kvserve eval --score-from N` compresses each window's first N tokens and scores the rest. SnapKV
chooses what to keep from the attention of queries that come before the scored text (the window's,
or the generic question's); here the queries are the scored tokens' own, run once over the
uncompressed cache before it is compressed. No online method sees them ahead of time: this is an
oracle, the bound on what any choice of positions by attention can keep for that text, and so what
a perplexity target at a given budget can ask of SnapKV.

It runs `kvserve eval` with the same arguments; in each `--config` that compresses with
`--kv-compression snapkv --snapkv-query generic`, the generic question is replaced by the window's
scored tokens (the probe is computed, scores the positions, and is dropped, as the question is):

    .venv/bin/python bench/eviction_oracle.py --model smollm2-135m-instruct --text /usr/share/common-licenses/GPL-3 \
      --context 2048 --score-from 1536 --max-windows 4 --greedy-prompts 0 --needle-lengths "" --kv-cache-memory 1 \
      --config "--kv-compression snapkv --snapkv-query generic --kv-budget 512"
"""

from __future__ import annotations

import sys

from kvserve.cli import main
from kvserve.engine.engine import LLMEngine


def score_by_the_scored_text(score_from: int):
    plain_score = LLMEngine.score

    def score(self, token_ids, cache_salt=None, chunk=None, compress_at=None):
        self._generic_question = list(token_ids[score_from:])
        return plain_score(self, token_ids, cache_salt=cache_salt, chunk=chunk, compress_at=compress_at)

    return score


if __name__ == "__main__":
    argv = sys.argv[1:]
    if "--score-from" not in argv:
        sys.exit("give --score-from N: the oracle scores the positions by the tokens from N on")
    LLMEngine.score = score_by_the_scored_text(int(argv[argv.index("--score-from") + 1]))
    sys.exit(main(["eval", *argv]))
