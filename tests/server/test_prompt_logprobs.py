"""Completions ``echo`` with ``logprobs`` (the prompt's log-probabilities) through the official
``openai`` client, checked against a direct transformers forward of the served model. The
server prefills in chunks of 8 tokens, so the prompt's records cross chunk boundaries."""
from __future__ import annotations

import openai
import pytest
import torch
from server_testlib import MODEL_NAME, start

PROMPT = [5 + (37 * i) % 280 for i in range(27)]  # 27 token ids: four prefill chunks


@pytest.fixture(scope="module")
def chunked(tiny_model_dir):
    with start(tiny_model_dir, max_batch_tokens=8) as running:
        yield running


@pytest.fixture(scope="module")
def client(chunked) -> openai.OpenAI:
    return openai.OpenAI(base_url=chunked.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Log-probabilities of every next token, [len(ids), vocab], from transformers."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir[0], torch_dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    return logprobs


def _check_prompt(lp, ref: torch.Tensor, top: int) -> None:
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts it
    got = torch.tensor(lp.token_logprobs[1:len(PROMPT)])
    want = ref[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for i in range(1, len(PROMPT)):
        # Keyed by token text: two top tokens of the same text (byte pieces) share one key.
        want = ref[i - 1].topk(top).values
        for value in lp.top_logprobs[i].values():
            assert (want - value).abs().min() < 1e-4
        assert max(lp.top_logprobs[i].values()) == pytest.approx(want[0].item(), abs=1e-4)


def test_echo_logprobs_match_transformers(client, chunked, reference):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0,
                                  echo=True, logprobs=2)
    choice = r.choices[0]
    lp = choice.logprobs
    prompt_text = chunked.on_engine(lambda _: chunked.model.tokenizer.decode(PROMPT))
    assert choice.text.startswith(prompt_text) and len(lp.tokens) == len(PROMPT) + 3
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    generated = chunked.on_engine(lambda _: chunked.model.tokenizer.encode(
        choice.text[len(prompt_text):], add_special_tokens=False))
    ref = reference(PROMPT + generated)
    _check_prompt(lp, ref, 2)
    # The generated tokens' records follow, from the same forward (greedy: each is the top one).
    for j, value in enumerate(lp.token_logprobs[len(PROMPT):]):
        assert value == pytest.approx(ref[len(PROMPT) - 1 + j].max().item(), abs=1e-4)


def test_prompt_scoring_bypasses_the_prefix_cache(client, reference):
    """A prompt already in the prefix cache is prefilled again (cached pages hold no logits);
    ``max_tokens=0`` scores a prompt without decoding."""
    plain = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=1, temperature=0)
    client.completions.create(**plain)
    assert client.completions.create(**plain).usage.prompt_tokens_details.cached_tokens > 0
    scored = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0, echo=True,
                                       logprobs=1)
    assert scored.usage.prompt_tokens_details.cached_tokens == 0
    assert scored.usage.completion_tokens == 0
    assert len(scored.choices[0].logprobs.tokens) == len(PROMPT)
    _check_prompt(scored.choices[0].logprobs, reference(PROMPT), 1)


def test_streamed_echo_carries_the_prompt_logprobs(client):
    kw = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, temperature=0, echo=True, logprobs=1)
    whole = client.completions.create(**kw).choices[0].logprobs
    chunks = [c for c in client.completions.create(stream=True, **kw) if c.choices]
    first = chunks[0].choices[0].logprobs  # the echo: the prompt's records, nothing generated
    assert first.tokens == whole.tokens[:len(PROMPT)]
    assert first.token_logprobs == pytest.approx(whole.token_logprobs[:len(PROMPT)], abs=1e-5)
