"""The router's rule for when prefill's first token may be sent ahead (``first_token``'s
``_incomplete``), held against vLLM's own incremental detokenizer on this build: for every
t1 the rule accepts, prefill's text for t1 followed by decode's text from prompt + [t1]
is, character for character, the monolithic engine's text. Prompts of random demo-token
ids end inside a UTF-8 character often (a quarter of the demo vocabulary is byte
fragments), which is what B5's random prompts did: the rule that refused any U+FFFD in
t1's text sent 167 of 287 B5 requests down the plain path (a hybrid decode then
recomputes the whole prompt).

The request handed to vLLM's detokenizer is a stand-in (``SimpleNamespace``: the four
fields its constructor reads); the tokenizer and the detokenizer are vLLM's and the
demo's own."""

from __future__ import annotations

import random
import types

import pytest

from vllm_flagcx.router import first_token

CASES = 400


@pytest.fixture(scope="module")
def detokenize(tmp_path_factory):
    """texts(prompt_ids, output_ids): vLLM's streamed text per output token."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    from vllm_flagcx.demo import model as demo

    directory = tmp_path_factory.mktemp("tokenizer")
    demo.write_tokenizer(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)

    def texts(prompt_ids: list[int], output_ids: list[int]) -> list[str]:
        request = types.SimpleNamespace(  # stand-in: what the detokenizer reads
            request_id="r", prompt_token_ids=prompt_ids, prompt_embeds=None,
            sampling_params=SamplingParams(max_tokens=len(output_ids)))
        detok = IncrementalDetokenizer.from_new_request(tokenizer, request)
        out = []
        for i, token in enumerate(output_ids):
            detok.update([token], False)
            out.append(detok.get_next_output_text(i == len(output_ids) - 1, True))
        return out

    return texts


def _cases(seed: int):
    rng = random.Random(seed)
    for _ in range(CASES):
        prompt = [rng.randrange(2, 500) for _ in range(rng.choice((8, 64)))]
        yield prompt, [rng.randrange(2, 500) for _ in range(4)]


def test_every_first_token_the_router_sends_ahead_gives_the_monolithic_text(detokenize):
    accepted = with_dangling_prompt = 0
    for prompt, outputs in _cases(7):
        t1_text = detokenize(prompt, outputs[:1])[0]  # prefill's answer: max_tokens 1
        if first_token._incomplete(t1_text, "length"):
            continue
        accepted += 1
        with_dangling_prompt += first_token.INCOMPLETE_CHARACTER in t1_text
        monolithic = "".join(detokenize(prompt, outputs))
        seeded = t1_text + "".join(detokenize(prompt + outputs[:1], outputs[1:]))
        assert seeded == monolithic, (prompt, outputs)
    # the rule is not vacuous: most t1 go ahead, those after a prompt that ends inside a
    # character included (the case a rule refusing any U+FFFD lost)
    assert accepted > CASES // 2 and with_dangling_prompt > 0


def test_a_first_token_that_ends_inside_a_character_is_refused(detokenize):
    """The first byte of a three-byte character: the monolithic engine holds it back."""
    prompt = [48, 79, 272]
    refused = 0
    for token in range(2, 500):
        text = detokenize(prompt, [token])[0]
        if text == "" or text.endswith(first_token.INCOMPLETE_CHARACTER):
            assert first_token._incomplete(text, "length")
            refused += 1
    assert refused >= 64  # the lead bytes of multi-byte characters in the byte alphabet
