"""``--generation-config``: a request that omits temperature / top_p samples with the served
model's own values (generation_config.json, GGUF metadata); ``none`` keeps OpenAI's."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from server_testlib import MODEL_NAME

from forkserve.config import ShareBase, app_config
from forkserve.interfaces.server.generation_defaults import (
    OPENAI_DEFAULTS,
    SamplingDefaults,
    load_sampling_defaults,
)
from forkserve.interfaces.server.launcher import serve_in_thread
from forkserve.interfaces.server.schemas import ChatCompletionRequest
from forkserve.interfaces.server.served_model import load_served_model


def _folder(tmp_path: Path, config: dict | None) -> Path:
    if config is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def test_generation_config_json_gives_the_defaults_it_states(tmp_path):
    path = _folder(tmp_path, {"temperature": 0.3, "top_p": 0.9, "top_k": 20, "do_sample": True})
    stated = SamplingDefaults(0.3, 0.9, str(path / "generation_config.json"))
    assert load_sampling_defaults(path) == stated
    assert load_sampling_defaults(path, "none") == OPENAI_DEFAULTS


@pytest.mark.parametrize("config", [None, {"bos_token_id": 1}, {"temperature": 7.0, "top_p": 0.0}])
def test_a_model_that_states_no_valid_value_keeps_openai_defaults(tmp_path, config):
    assert load_sampling_defaults(_folder(tmp_path, config)) == OPENAI_DEFAULTS


def test_an_invalid_value_is_dropped_alone(tmp_path):
    defaults = load_sampling_defaults(_folder(tmp_path, {"temperature": 0.5, "top_p": 1.5}))
    assert (defaults.temperature, defaults.top_p) == (0.5, 1.0)


def test_gguf_sampling_metadata_gives_the_defaults(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_float32("general.sampling.temp", 0.25)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert load_sampling_defaults(path) == SamplingDefaults(0.25, 1.0, str(path))


def test_a_request_keeps_what_it_sets_and_takes_the_defaults_for_the_rest():
    defaults = SamplingDefaults(0.2, 0.8, "model")
    msgs = [{"role": "user", "content": "hi"}]

    def request(**given) -> ChatCompletionRequest:
        return ChatCompletionRequest(model="m", messages=msgs, **given)

    assert defaults.resolve(request()) == (0.2, 0.8)
    assert defaults.resolve(request(temperature=1.0)) == (1.0, 0.8)
    assert defaults.resolve(request(top_p=0.5)) == (0.2, 0.5)


def test_served_model_samples_greedily_when_its_config_says_temperature_0(tiny_model_dir, tmp_path):
    import httpx
    import openai

    path, _ = tiny_model_dir
    greedy_dir = shutil.copytree(path, tmp_path / MODEL_NAME)
    (greedy_dir / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))
    config = app_config(page_size=4, num_pages=256, share_base=ShareBase.EXACT)
    model = load_served_model(greedy_dir, config=config, device="cpu", dtype="float32",
                              attention="eager")
    assert model.sampling_defaults.temperature == 0.0
    with serve_in_thread(model) as running:
        # /v1/models says what a request that omits them samples with, and the sharing policy.
        cards = httpx.get(running.url + "/v1/models").json()["data"]
        assert cards and all(c["sampling_defaults"] == {
            "temperature": 0.0, "top_p": 1.0, "source": str(greedy_dir / "generation_config.json")}
            and c["share_base"] == "exact" for c in cards)
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)
        kw = dict(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=12)
        texts = {client.completions.create(**kw, seed=s).choices[0].text for s in range(3)}
        explicit = client.completions.create(**kw, temperature=0).choices[0].text
        sampled = {client.completions.create(**kw, temperature=1.0, seed=s).choices[0].text
                   for s in range(3)}
    assert texts == {explicit}
    assert len(sampled) > 1  # the seeds matter at temperature 1: the test above could fail
