"""Structured outputs (xgrammar): every output follows its JSON schema, regex, choices or grammar,
greedy and sampled, alone, batched, from the prefix cache, with n > 1; the token mask never lets a
forbidden token through (full logits or not); constraints are bounded and their errors name the field."""

from __future__ import annotations

import json
import math
import random
import re
import threading
import time

import httpx
import jsonschema
import openai
import pytest
import torch
import xgrammar as xgr

from json_schemas import random_schemas
from kvserve import LLM, SamplingParams
from kvserve.engine.sampler import Sampler
from kvserve.engine.sequence import Sequence
from kvserve.structured.spec import MAX_GRAMMAR_CHARS, GrammarError, StructuredOutputs
from server_process import launch_server, stop_server

SCHEMAS = random_schemas(50, seed=0)
REGEXES = [r"\(\d{3}\) \d{3}-\d{4}", r"[a-z]{3,8}@[a-z]{2,6}\.(com|org)", r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d)"]
ARITHMETIC = 'root ::= term (("+" | "-") term){0,3}\nterm ::= [0-9]{1,3} | "(" [0-9]{1,3} "*" [0-9]{1,3} ")"'
ARITHMETIC_RE = r"(\d{1,3}|\(\d{1,3}\*\d{1,3}\))([+-](\d{1,3}|\(\d{1,3}\*\d{1,3}\))){0,3}"


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return LLM(str(tiny_dir("llama")), dtype="float32", kv_cache_memory=0.05)


@pytest.fixture(scope="module")
def smollm():
    return LLM("smollm2-135m-instruct", kv_cache_memory=0.5)


def constrained(spec: StructuredOutputs, **kwargs) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 400, **kwargs}, structured_outputs=spec)


def assert_valid(outputs, schemas) -> None:
    for out, schema in zip(outputs, schemas, strict=True):
        assert out.finish_reason == "stop", (out.text, schema)
        jsonschema.validate(json.loads(out.text), schema)  # json.loads is strict: no raw control characters in strings


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_fifty_random_schemas_validate_on_a_tiny_random_model(tiny, temperature):
    """A random model draws whatever the mask leaves it: the grammar alone makes these valid."""
    params = [constrained(StructuredOutputs(json=s), temperature=temperature, seed=i) for i, s in enumerate(SCHEMAS)]
    assert_valid(tiny.generate(["The program is free software"] * len(SCHEMAS), params, use_tqdm=False), SCHEMAS)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_fifty_random_schemas_validate_on_smollm2(smollm, temperature):
    params = [constrained(StructuredOutputs(json=s), temperature=temperature, seed=i) for i, s in enumerate(SCHEMAS)]
    prompts = [f"Reply in JSON about {word}:\n" for word in ("books", "cities", "people", "songs", "tools") * 10]
    assert_valid(smollm.generate(prompts, params, use_tqdm=False), SCHEMAS)


def test_schemas_that_smollm2_would_not_follow_unconstrained(smollm):
    """The same prompt without the constraint gives prose, not the schema: the mask is what holds."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "rank": {"type": "integer", "minimum": 1,
              "maximum": 9}}, "required": ["city", "rank"], "additionalProperties": False}  # fmt: skip
    prompt = "Tell me about Paris."
    free = smollm.generate([prompt], SamplingParams(max_tokens=40, temperature=0), use_tqdm=False)[0].text
    with pytest.raises(ValueError):
        jsonschema.validate(json.loads(free), schema)
    out = smollm.generate([prompt], constrained(StructuredOutputs(json=schema), temperature=0), use_tqdm=False)
    assert_valid(out, [schema])


def test_choice_regex_and_grammar_outputs_follow_them(tiny):
    choices = ("yes", "no", "maybe not", 'say "hi"\n')
    params = [constrained(StructuredOutputs(choice=choices), temperature=1.0, seed=i) for i in range(24)]
    outs = tiny.generate(["Is it free software?"] * 24, params, use_tqdm=False)
    assert {o.text for o in outs} <= set(choices) and len({o.text for o in outs}) > 1
    for regex in REGEXES:
        outs = tiny.generate(["Contact:"] * 8, [constrained(StructuredOutputs(regex=regex), temperature=1.0, seed=i) for i in range(8)],
                             use_tqdm=False)  # fmt: skip
        assert all(re.fullmatch(regex, o.text) for o in outs), [o.text for o in outs]
    outs = tiny.generate(["2 + 2 ="] * 8, [constrained(StructuredOutputs(grammar=ARITHMETIC), temperature=1.0, seed=i, max_tokens=64)
                                           for i in range(8)], use_tqdm=False)  # fmt: skip
    assert all(o.finish_reason == "stop" and re.fullmatch(ARITHMETIC_RE, o.text) for o in outs), [o.text for o in outs]


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_a_single_row_takes_the_mask_on_every_path(tiny, temperature):
    """One greedy or sampled row would take the lm_head's argmax or the int8 screen unconstrained; with a
    grammar it samples from masked full logits (a forbidden token would fail the request's step)."""
    for seed in range(4):
        out = tiny.generate(["Contact:"], constrained(StructuredOutputs(regex=REGEXES[1]), temperature=temperature, seed=seed),
                            use_tqdm=False)[0]  # fmt: skip
        assert out.finish_reason == "stop" and re.fullmatch(REGEXES[1], out.text)


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "seeded"])
def test_constrained_tokens_are_the_same_alone_batched_and_from_the_prefix_cache(tiny_dir, temperature):
    prompt = "This License applies to any program or other work which contains a notice " * 4
    specs = [StructuredOutputs(json=s) for s in SCHEMAS[:6]]
    params = [constrained(spec, temperature=temperature, seed=11) for spec in specs]
    alone = []
    for p in params:
        llm = LLM(str(tiny_dir("llama")), dtype="float32", kv_cache_memory=0.05, enable_prefix_caching=False)
        alone.append(llm.generate([prompt], p, use_tqdm=False)[0].token_ids)
    cached = LLM(str(tiny_dir("llama")), dtype="float32", kv_cache_memory=0.05)
    noise = [SamplingParams(max_tokens=30, temperature=1.0, seed=i) for i in range(10)]
    for _ in range(2):  # the second round finds the prompt in the prefix cache
        outs = cached.generate([prompt] * 6 + ["The GNU General Public License"] * 10, params + noise, use_tqdm=False)
        assert [o.token_ids for o in outs[:6]] == alone
    assert cached.engine.prefix_cache_stats()["prefix_cache_hits_total"] > 0


def test_logprobs_of_a_constrained_row_are_over_the_allowed_tokens(tiny):
    yes, no = (tiny.tokenizer.encode(w, add_special_tokens=False) for w in ("yes", "no"))
    outs = tiny.generate(["Is it?"] * 4, [constrained(StructuredOutputs(choice=("yes", "no")), temperature=1.0, seed=i, logprobs=5)
                                          for i in range(4)], use_tqdm=False)  # fmt: skip
    for out in outs:
        first = out.logprobs[0]
        assert set(first.top) == {yes[0], no[0]} and sum(math.exp(v) for v in first.top.values()) == pytest.approx(1, abs=1e-5)
        for lp in out.logprobs[1:]:  # one token allowed: it is the only entry, with all the mass
            assert list(lp.top) == [lp.token_id] and lp.logprob == pytest.approx(0, abs=1e-6)
        allowed = {tiny.tokenizer.eos_token_id, *yes, *no}
        assert all(set(lp.top) <= allowed for lp in out.logprobs)


def test_n_samples_each_follow_the_schema(tiny):
    schema = SCHEMAS[3]
    out = tiny.generate(["The program"], SamplingParams(max_tokens=400, n=4, temperature=1.0, seed=2,
                                                         structured_outputs=StructuredOutputs(json=schema)), use_tqdm=False)  # fmt: skip
    assert len(out) == 4 and len({o.text for o in out}) > 1
    assert_valid(out, [schema] * 4)


def test_json_object_gives_a_json_object(tiny):
    outs = tiny.generate(["{"] * 6, [constrained(StructuredOutputs(json_object=True), temperature=1.0, seed=i, max_tokens=2000)
                                     for i in range(6)], use_tqdm=False)  # fmt: skip
    done = [o for o in outs if o.finish_reason == "stop"]
    assert done and all(isinstance(json.loads(o.text), dict) for o in done)


@pytest.mark.parametrize("native", [True, False], ids=["kernel", "torch"])
def test_a_grammar_that_allows_no_token_gives_no_token(native):
    """A vocabulary that cannot write what the grammar needs next (no "c" here): the sampler reports no
    token for that row instead of drawing a forbidden one; the engine ends such a request (stop_reason "grammar")."""
    info = xgr.TokenizerInfo(["a", "b", "</s>"], stop_token_ids=[2])
    stuck = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar('root ::= "a" "c"'))
    free = Sequence("free", [1, 2], SamplingParams(temperature=0))
    ended = Sequence("stuck", [1, 2], SamplingParams(temperature=1.0, logprobs=1), grammar=stuck)
    results = Sampler(native=native).sample(torch.tensor([[0.0, 1.0, 2.0], [0.0, 3.0, 1.0]]), [free, ended])
    assert [r.token_id for r in results] == [2, 0]  # "a" alone is allowed first
    assert stuck.accept_token(0)
    results = Sampler(native=native).sample(torch.tensor([[0.0, 1.0, 2.0], [0.0, 3.0, 1.0]]), [free, ended])
    assert results[0].token_id == 2 and results[1].token_id is None


def test_constraints_are_bounded_and_their_errors_say_what_is_wrong(tiny):
    cases = [
        (dict(json="{"), "not valid JSON"),
        (dict(json={"type": "nonsense"}), 'Unsupported type "nonsense"'),
        (dict(regex="(a"), "missing ), unterminated subpattern"),
        (dict(regex=r"(a)\1"), "Backreference"),
        (dict(grammar="root ::= undefined_rule"), 'Rule "undefined_rule" is not defined'),
        (dict(choice=()), "1 to"),
        (dict(choice=("a", "")), "non-empty"),
        (dict(regex="a" * (MAX_GRAMMAR_CHARS + 1)), "at most"),
        (dict(json={"enum": ["x" * MAX_GRAMMAR_CHARS]}), "at most"),
        (dict(json=json.loads("[" * 100 + "]" * 100)), "object"),
        (dict(json={"items": json.loads('{"items":' * 100 + "{}" + "}" * 100)}), "deeper than"),
        (dict(regex="a", choice=("a",)), "exactly one"),
        (dict(json={"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]}), "required names 'b'"),
        (dict(json={"items": {"properties": {}, "required": ["x"]}}), "required names 'x'"),
        (dict(), "exactly one"),
        # found by QA: forms xgrammar reads otherwise than Python's re, answered 200 with output that broke them; the
        # checks a schema's pattern already had ("a$b" gave "ab", "a\\Z" "aZ", "\\x41BC" one CJK character, "a[\\x00]b" "ab")
        (dict(regex="a$b"), "inside the regex"),
        (dict(regex="a\\Z"), "\\A, \\Z"),
        (dict(regex="\\x41BC"), "\\x escape"),
        (dict(regex="a[\\x00]b"), "holds only NUL"),
        (dict(regex="(?=a)a"), "lookahead"),
        (dict(grammar='root ::= "a" [\\0] "b"'), "holds only NUL"),
        (dict(grammar='root ::= [a-z]+ (="x")'), "lookahead assertion"),
        (dict(regex="\\01"), "octal escape"),  # Python's U+0001; xgrammar generated "1"
        (dict(regex="[\\d-z]{3}"), "not one Python's re reads"),
        (dict(regex="\\Qabc\\E"), "not one Python's re reads"),
    ]
    for fields, message in cases:
        with pytest.raises(GrammarError, match=re.escape(message)):
            spec = StructuredOutputs(**fields)
            tiny.generate(["x"], constrained(spec), use_tqdm=False)
    assert tiny.engine.num_running == 0 and tiny.engine.num_waiting == 0


# (schema, an instance it must refuse, one it must take), separators as the compact grammar writes them
ENFORCED_KEYWORDS = {
    "minimum": ({"type": "integer", "minimum": 3}, "2", "3"),
    "exclusiveMaximum": ({"type": "integer", "exclusiveMaximum": 3}, "3", "2"),
    "multipleOf (integer)": ({"type": "integer", "multipleOf": 3}, "4", "6"),
    "minLength": ({"type": "string", "minLength": 3}, '"ab"', '"abc"'),
    "pattern": ({"type": "string", "pattern": "^a+$"}, '"b"', '"aa"'),
    "format date": ({"type": "string", "format": "date"}, '"x"', '"2024-01-01"'),
    "format uuid": ({"type": "string", "format": "uuid"}, '"x"', '"123e4567-e89b-12d3-a456-426614174000"'),
    "enum": ({"enum": ["a", "b"]}, '"c"', '"a"'),
    "minItems": ({"type": "array", "items": {"type": "integer"}, "minItems": 2}, "[1]", "[1, 2]"),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "integer"}], "items": False}, "[1, 2]", "[1]"),
    "required": ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, "{}", '{"a": 1}'),
    "patternProperties": ({"type": "object", "patternProperties": {"^x$": {"type": "integer"}}, "additionalProperties": False},
                          '{"y": 1}', '{"x": 1}'),
    "maxProperties": ({"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 1}, '{"a": 1, "b": 2}', '{"a": 1}'),
    "propertyNames": ({"type": "object", "additionalProperties": {"type": "integer"}, "propertyNames": {"pattern": "^a"}}, '{"b": 1}',
                      '{"a": 1}'),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, '"s"', "1"),
    "allOf of one": ({"allOf": [{"type": "integer"}]}, '"s"', "1"),
    "$ref with a description": ({"$defs": {"a": {"type": "integer"}}, "type": "object", "required": ["x"],
                                 "properties": {"x": {"$ref": "#/$defs/a", "description": "d"}}}, '{"x": "s"}', '{"x": 1}'),
    "a character class spanning the surrogates": ({"type": "string", "pattern": "^[a-c]+$"}, '"d"', '"abc"'),
}  # fmt: skip


@pytest.mark.parametrize("name", ENFORCED_KEYWORDS)
def test_keywords_the_docs_call_enforced_are_enforced(name):
    """docs/structured-outputs.md lists what the grammar enforces; each refuses an instance that breaks it."""
    from xgrammar.testing import _is_grammar_accept_string

    from kvserve.structured.compiler import grammar_text

    schema, bad, good = ENFORCED_KEYWORDS[name]
    grammar = xgr.Grammar.from_ebnf(grammar_text(StructuredOutputs(json=schema)))
    assert _is_grammar_accept_string(grammar, good) and not _is_grammar_accept_string(grammar, bad)


@pytest.mark.parametrize("schema, message", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "at /: 'uniqueItems'"),
    ({"type": "object", "properties": {"t": {"type": "array", "contains": {"const": 5}}}}, "at /properties/t: 'contains'"),
    ({"allOf": [{"type": "integer", "minimum": 3}, {"maximum": 5}]}, "'allOf' with more than one"),
    ({"type": "integer", "not": {"const": 3}}, "'not'"),
    ({"type": "integer", "if": {"minimum": 3}, "then": {"maximum": 5}}, "'if'"),
    ({"type": "object", "properties": {"a": {}, "b": {}}, "dependentRequired": {"a": ["b"]}}, "'dependentRequired'"),
    ({"$defs": {"a": {"type": "integer"}}, "$ref": "#/$defs/a", "maximum": 6}, "'maximum' beside $ref"),
    ({"$defs": {"a": {"$anchor": "foo", "type": "integer"}}, "$ref": "#foo"}, "not a JSON pointer"),
    ({"type": "integer", "anyOf": [{"minimum": 5}, {"maximum": 1}]}, "'type' beside anyOf"),
    ({"type": "number", "multipleOf": 0.5}, "'multipleOf' is enforced only for type integer"),
    ({"anyOf": []}, "'anyOf' is an empty list"),
    ({"type": []}, "'type' is an empty list"),
    ({"type": "integer", "minimum": 2**63}, "outside 64-bit integers"),
    ({"type": "string", "pattern": "^[\\ud800-\\udfff]+$"}, "surrogates"),
    ({"type": "object", "required": ["a"]}, "required names 'a'"),
    # the second QA pass
    ({"type": "string", "pattern": "^(?=.*[0-9])[a-z0-9]{4}$"}, "lookahead"),
    ({"type": "string", "pattern": "^a$b"}, "inside the pattern"),
    ({"type": "string", "enum": [1, 2]}, "not of type 'string'"),
    ({"type": "string", "enum": ["abc", "x"], "maxLength": 1}, "'maxLength' beside enum"),
    ({"type": "string", "pattern": "^ab\\u0000cd$"}, "NUL"),
    ({"type": "string", "pattern": 5}, "a pattern is a string"),
    ({"type": "array", "uniqueItems": "yes"}, "uniqueItems is a boolean"),
    # the third QA pass
    ({"type": "string", "pattern": "^C:\\\\[a-z]+$"}, "unescaped"),
    ({"type": "string", "pattern": '^a"b$'}, "unescaped"),
    ({"type": "string", "pattern": "^[a-z]+$", "minLength": 6}, "'minLength' beside pattern"),
    ({"type": "string", "pattern": "(a$)b"}, "inside the pattern"),
    ({"type": "string", "pattern": "^x(?:^|,)y$"}, "inside the pattern"),
    ({"type": "string", "pattern": "\\Aabc\\Z"}, "\\A, \\Z"),
    ({"type": "string", "pattern": "^\\x41BC$"}, "more than two"),
    ({"enum": ["a", "b"], "const": "c"}, "'const' beside enum"),
    # a range narrower than the six decimals xgrammar generates numbers in compiled to a grammar nothing completes
    ({"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1e-7}, "holds no number of at most six decimal places"),
    ({"type": "number", "minimum": 0.1000001, "maximum": 0.1000002}, "holds no number"),
    ({"type": "number", "exclusiveMinimum": 0.5, "exclusiveMaximum": 0.500001}, "holds no number"),
    # found by QA: an integer's multipleOf was dropped past 1024 or beside one bound only ({"n": 10} came back for multiples of 7)
    ({"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 7, "minimum": 1}}}, "at /properties/n: 'multipleOf'"),
    ({"type": "integer", "multipleOf": 7, "exclusiveMaximum": 50}, "without minimum or maximum"),
    ({"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 1000000}, "without minimum or maximum"),  # gave 201845
    ({"type": "integer", "multipleOf": 1025}, "whole number in 1..1024"),
    ({"type": "integer", "multipleOf": 2.5}, "whole number"),
    ({"type": "integer", "multipleOf": 0}, "whole number"),
    # bounds that are no bounds answered 200 as if unbounded, or a 400 quoting the compiler's grammar text
    ({"type": "array", "minItems": -5}, "minItems must be a non-negative integer, got -5"),
    ({"type": "string", "maxLength": -1}, "maxLength must be a non-negative integer"),
    ({"type": "string", "minLength": -3}, "minLength must be a non-negative integer"),
    ({"type": "string", "minLength": 1.5}, "minLength must be a non-negative integer"),
    ({"type": "array", "minItems": 4, "maxItems": 2}, "minItems 4 is larger than maxItems 2"),
    ({"type": "object", "minProperties": True}, "minProperties must be a non-negative integer"),
])  # fmt: skip
def test_schemas_the_grammar_would_not_follow_are_refused_with_where(schema, message):
    """Found by QA: these keywords compiled to nothing, and outputs broke them with finish_reason stop."""
    with pytest.raises(GrammarError, match=re.escape(message)):
        StructuredOutputs(json=schema)


@pytest.mark.parametrize("bounds, least", [
    ({"minimum": 0.1, "maximum": 0.1000001}, "0.1"),
    ({"exclusiveMinimum": 0.5, "exclusiveMaximum": 0.50001}, "0.500001"),
    ({"minimum": -1, "maximum": -0.9999999}, "-1"),
    ({"minimum": 0.000001, "maximum": 0.0000015}, "0.000001"),
    ({"exclusiveMinimum": -0.0000015, "maximum": -0.000001}, "-0.000001"),
])  # fmt: skip
def test_a_narrow_number_range_that_holds_a_generated_number_compiles_and_generates_it(bounds, least):
    """The refusal above is exact: the least six-decimal number in a range it lets through is generated."""
    from xgrammar.testing import _is_grammar_accept_string

    from kvserve.structured.compiler import grammar_text

    grammar = xgr.Grammar.from_ebnf(grammar_text(StructuredOutputs(json={"type": "number", **bounds})))
    assert _is_grammar_accept_string(grammar, least)


def test_patterns_keep_off_the_surrogates_and_the_rewrite_is_stable():
    """Found by QA (second pass): ., negated classes and \\S in a schema's pattern admitted the bytes of a
    UTF-16 surrogate, which decode to U+FFFD; common anchored alternatives stay accepted."""
    from xgrammar.testing import _get_matcher_from_grammar

    from kvserve.structured.compiler import grammar_text
    from kvserve.structured.spec import schema_text

    for pattern in ("^.+$", "^[^a]+$", r"^\S+$", "^a$|^b$"):
        schema = {"type": "string", "pattern": pattern}
        grammar = xgr.Grammar.from_ebnf(grammar_text(StructuredOutputs(json=schema)))
        for data, taken in ((b'"\xed\xb2\x80"', False), (b'"b"', True)):
            matcher = _get_matcher_from_grammar(grammar)
            assert (matcher.accept_string(data) and matcher.is_terminated()) == taken, (pattern, data)
        once = schema_text(schema)
        assert schema_text(once) == once  # a tool's parameters pass twice


def test_common_patterns_and_annotations_stay_accepted():
    """What the refusals above must not catch: anchored alternatives, escaped anchors, classes holding
    quotes or controls, and vendor keywords beside $ref or enum (annotations, as JSON Schema has them)."""
    for pattern in ("^a$|^b$", r"^\$\d+$", "^[a-z^$]+$", r"^[\w.+-]+@[\w-]+\.[\w.]+$", r"^\+?[0-9 ()-]{7,20}$", '^[^"]+$', r"^[\t ]+$",
                    r"^(\([0-9]{3}\))?[0-9]{3}-[0-9]{4}$"):  # fmt: skip
        StructuredOutputs(json={"type": "string", "pattern": pattern})
    StructuredOutputs(json={"$ref": "#/$defs/X", "x-order": 1, "nullable": True, "$defs": {"X": {"type": "integer"}}})
    StructuredOutputs(json={"type": "string", "enum": ["a"], "example": "a", "x-enum-varnames": ["A"]})


def test_data_inside_a_schema_is_not_read_as_a_schema():
    """Found by QA: "required" inside const, default or examples (data) was checked as if it were a schema."""
    for schema in ({"const": {"required": ["x"]}}, {"type": "integer", "examples": [{"required": ["z"]}]},
                   {"type": "object", "properties": {"q": {"type": "integer"}}, "default": {"required": ["q"]}}):  # fmt: skip
        StructuredOutputs(json=schema)


def test_choices_regexes_and_grammars_that_are_not_text_are_refused():
    """Found by QA: NUL in a choice and surrogates in a regex or grammar came out as cut or invalid UTF-8 text."""
    from kvserve.structured.compiler import grammar_text

    for fields in (dict(choice=["a\x00b"]), dict(regex=r"\ud800"), dict(regex=r"[\ud800-\udfff]"), dict(grammar="root ::= [\\uD800-\\uDFFF]+"),
                   dict(regex="ab\\u0000cd"), dict(grammar='root ::= "ab" "\\x00" "cd"'), dict(grammar='root ::= "[" "\\x00" "]"')):  # fmt: skip
        with pytest.raises(GrammarError, match="surrogate|NUL"):
            grammar_text(StructuredOutputs(**fields))
    spanning = grammar_text(StructuredOutputs(regex=r"[\u0000-\uffff]+"))
    assert "\\U0000d7ff\\U0000e000" in spanning  # the class keeps everything but the surrogates


def test_compiled_grammars_are_cached_by_constraint(tiny):
    grammars = tiny.engine.grammars
    spec = StructuredOutputs(regex=r"[0-9]{4}-cache-test")
    first = grammars.compile(spec)
    assert grammars.compile(StructuredOutputs(regex=r"[0-9]{4}-cache-test")) is first
    for i in range(grammars._max_cached):
        grammars.compile(StructuredOutputs(regex=f"x{i}"))
    assert grammars.cached(spec) is None  # the least recently used went first


def test_random_model_under_every_schema_stays_in_the_mask_when_preempted(tiny_dir):
    """A pool too small for the batch preempts and recomputes: the matchers keep their state."""
    llm = LLM(str(tiny_dir("llama")), dtype="float32", num_kv_blocks=24, max_num_seqs=16)
    rng = random.Random(4)
    schemas = rng.sample(SCHEMAS, 16)
    params = [constrained(StructuredOutputs(json=s), temperature=1.0, seed=i) for i, s in enumerate(schemas)]
    outs = llm.generate(["The GNU General Public License is a free, copyleft license"] * 16, params, use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    assert_valid(outs, schemas)


# ---------------------------------------------------------------------- the server, with the openai client
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}, "population": {"type": "integer", "minimum": 0,
        "maximum": 40000000}, "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3}},
        "required": ["city", "population", "landmarks"], "additionalProperties": False}  # fmt: skip
MESSAGES = [{"role": "user", "content": "Name a big city, its population and some landmarks."}]


@pytest.fixture(scope="module")
def server():
    proc, url = launch_server(["--port", "0", "--kv-cache-memory", "0.25", "--grammar-compile-timeout", "2"])  # SmolLM2, the default
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


def post(server: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(server + path, json={"max_tokens": 64, **body}, timeout=120)


def test_response_format_json_schema_streamed_and_not(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    for temperature in (0.0, 1.0):
        kwargs = dict(model="smollm2-135m-instruct", messages=MESSAGES, response_format=response_format, max_tokens=120, n=2,
                      temperature=temperature, seed=5)  # fmt: skip
        whole = client.chat.completions.create(**kwargs)
        texts = {c.index: c.message.content for c in whole.choices}
        streamed: dict[int, str] = {}
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            for c in chunk.choices:
                streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
        assert streamed == texts
        for c in whole.choices:
            assert c.finish_reason == "stop"
            jsonschema.validate(json.loads(c.message.content), CITY)


def test_random_schemas_streamed_and_not_through_the_api(client):
    """Six of the random schemas as vLLM's guided_json, streamed and not, greedy and seeded: the same text, valid."""
    for i, schema in enumerate(SCHEMAS[:6]):
        for temperature in (0.0, 1.0):
            kwargs = dict(model="smollm2-135m-instruct", prompt="Reply in JSON:\n", max_tokens=300, temperature=temperature, seed=i,
                          extra_body={"guided_json": schema})  # fmt: skip
            whole = client.completions.create(**kwargs).choices[0]
            streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True) if c.choices)
            assert whole.finish_reason == "stop" and streamed == whole.text
            jsonschema.validate(json.loads(whole.text), schema)


def test_json_object_choice_regex_and_grammar_through_the_api(server, client):
    out = client.chat.completions.create(model="smollm2-135m-instruct", messages=MESSAGES, response_format={"type": "json_object"},
                                         max_tokens=200, temperature=0)  # fmt: skip
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    for body, check in [
        ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        ({"structured_outputs": {"choice": ["red", "blue"]}}, lambda t: t in ("red", "blue")),
        ({"guided_regex": REGEXES[0]}, lambda t: re.fullmatch(REGEXES[0], t)),
        ({"structured_outputs": {"regex": REGEXES[2], "disable_any_whitespace": True}}, lambda t: re.fullmatch(REGEXES[2], t)),
        ({"guided_grammar": ARITHMETIC, "guided_decoding_backend": "xgrammar"}, lambda t: re.fullmatch(ARITHMETIC_RE, t)),
        ({"guided_json": CITY}, lambda t: jsonschema.validate(json.loads(t), CITY) is None),
        ({"guided_json": json.dumps(CITY)}, lambda t: jsonschema.validate(json.loads(t), CITY) is None),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": CITY}}},
         lambda t: jsonschema.validate(json.loads(t), CITY) is None),
    ]:
        resp = post(server, "/v1/completions", {"prompt": "Answer: ", "n": 3, "temperature": 1.0, "max_tokens": 120, **body})
        assert resp.status_code == 200, resp.text
        for choice in resp.json()["choices"]:
            assert choice["finish_reason"] == "stop" and check(choice["text"]), (body, choice)
    plain = post(server, "/v1/completions", {"prompt": "Answer: ", "response_format": {"type": "text"}, "temperature": 0})
    assert plain.status_code == 200
    anything = post(server, "/v1/completions", {"prompt": "Answer: ", "guided_json": True, "max_tokens": 40})  # the schema true
    assert anything.status_code == 200, anything.text
    tools = post(server, "/v1/completions", {"prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]})
    assert tools.status_code == 400 and tools.json()["error"]["param"] == "tools"  # chat's field, refused rather than ignored
    # found by QA: a constraint no text completes ended as if complete (stop_reason null)
    dead = post(server, "/v1/completions", {"prompt": "x", "guided_regex": r"a[^\s\S]", "max_tokens": 8}).json()["choices"][0]
    assert (dead["text"], dead["finish_reason"], dead["stop_reason"]) == ("a", "stop", "grammar"), dead


@pytest.mark.parametrize("body, param, message", [
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "one constraint per request"),
    ({"response_format": {"type": "json_object"}, "guided_json": {}}, "guided_json", "one constraint per request"),
    ({"response_format": {"type": "xml"}}, "response_format", "not supported"),
    ({"response_format": {"json_schema": {}}}, "response_format", "needs a type"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs json_schema"),
    ({"guided_json": {"type": "nonsense"}}, "guided_json", 'Unsupported type "nonsense"'),
    ({"guided_json": "{"}, "guided_json", "not valid JSON"),
    ({"guided_json": 5}, "guided_json", "is an object (or true)"),
    ({"guided_json": False}, "guided_json", "schema is false"),  # no value satisfies it (QA: it generated anything)
    ({"guided_json": {"not": {}}}, "guided_json", "schema is false"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": False}}}, "response_format", "schema is false"),
    ({"guided_json": {"type": "object", "properties": {"a": {}}, "required": ["a", "b"]}}, "guided_json", "required names 'b'"),
    ({"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json", "'uniqueItems' is not enforced"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}}, "response_format", "letters"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes", "schema": {}}}}, "response_format",
     "strict must be a boolean"),
    ({"guided_choice": ["a\u0000b"]}, "guided_choice", "NUL"),
    ({"guided_regex": "(a"}, "guided_regex", "unterminated subpattern"),
    ({"guided_regex": "a" * 70000}, "guided_regex", "at most"),
    ({"guided_json": json.loads('{"items":' * 100 + "{}" + "}" * 100)}, "guided_json", "deeper than"),
    ({"guided_json": {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}}}, "guided_json", "at most"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar", "not defined"),
    ({"guided_choice": []}, "guided_choice", "1 to"),
    ({"guided_choice": "yes"}, "guided_choice", "valid list"),
    ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "structural_tag"),
    ({"structured_outputs": {"json_object": True, "disable_any_whitespace": False}}, "structured_outputs", "disable_any_whitespace"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend", "xgrammar"),
    ({"guided_whitespace_pattern": " *", "guided_json": {}}, "guided_whitespace_pattern", "not supported"),
], ids=lambda v: v if isinstance(v, str) and len(v) < 30 else None)  # fmt: skip
def test_bad_constraints_are_400s_naming_the_field(server, body, param, message):
    for path, extra in [("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": MESSAGES})]:
        resp = post(server, path, {**extra, **body})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == param and message in error["message"], error


def test_a_schema_too_slow_to_compile_is_a_400_in_bounded_time_and_the_server_stays_responsive(server):
    """2,500 properties take SmolLM2's vocabulary over a minute to compile: the compile runs in a child
    process, killed at --grammar-compile-timeout (2 s here); /health answers meanwhile."""
    slow = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(2500)}}
    pings: list[float] = []
    done = threading.Event()

    def ping() -> None:
        while not done.is_set():
            started = time.perf_counter()
            assert httpx.get(server + "/health", timeout=10).status_code == 200
            pings.append(time.perf_counter() - started)
            time.sleep(0.05)

    pinger = threading.Thread(target=ping)
    pinger.start()
    started = time.monotonic()
    try:
        resp = post(server, "/v1/completions", {"prompt": "x", "guided_json": slow})
    finally:
        done.set()
        pinger.join()
    assert time.monotonic() - started < 30  # the limit plus a restart of the compiler process, not 74 s
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "guided_json"
    assert "took longer than 2 s" in resp.json()["error"]["message"]
    assert len(pings) >= 5 and max(pings) < 1.0, pings  # the event loop never waited on the compile
    ok = post(server, "/v1/completions", {"prompt": "x", "guided_choice": ["a", "b"]})  # a fresh compiler process
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] in ("a", "b")


def test_a_regex_dot_is_any_character_but_a_newline_as_in_python(smollm):
    """xgrammar writes `.` as every code point; Python's re (and the fullmatch checks) leave out the newline."""
    for text, allowed in (("a\nb", False), ("a-b", True), ("aéb", True)):
        matcher = smollm.engine.grammars.matcher(StructuredOutputs(regex="a.b"))
        assert matcher.accept_string(text) == allowed == bool(re.fullmatch("a.b", text)), text


def test_format_ipv4_admits_no_leading_zeros(smollm):
    """xgrammar's ipv4 octets admit "01"; the format (and Python's ipaddress) does not."""
    import ipaddress

    for address in ("1.2.3.4", "01.2.3.4", "10.00.1.1", "255.255.255.255", "256.1.1.1", "0.0.0.0"):
        matcher = smollm.engine.grammars.matcher(StructuredOutputs(json={"type": "string", "format": "ipv4"}))
        try:
            valid = bool(ipaddress.IPv4Address(address))
        except ValueError:
            valid = False
        assert matcher.accept_string(f'"{address}"') == valid, address
