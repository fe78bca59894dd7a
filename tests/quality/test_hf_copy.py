"""hf_copy: a tiny GGUF's float32 copy loads as the GGUF does (the same state_dict bit for bit,
the same tokenizer and chat template), is made once and only once for the file's current
contents, and never leaves a half-written folder behind. tokenizer_copy: the same for the
tokenizer alone, which every load of a GGUF reads."""
import json
import os

import pytest
import torch
from quality_testlib import needs_bfcl, tiny_gguf

from benchmarks.quality import train
from forkserve.backend.torch import gguf_hf_copy as hf_copy
from forkserve.backend.torch.tokenizer import Tokenizer

CHAT = [{"role": "system", "content": "You call functions: f(x)."},
        {"role": "user", "content": "Héllo  wörld\n\tdef f(x): return {'a': [1, 2]}  🙂"}]
TEXTS = ["def f(x): return {'a': [1, 2]}  # héllo", "  leading spaces\n\n<|im_start|>x",
         "🙂 ünïcode"]


@pytest.mark.parametrize("tied", [False, True])
def test_the_copy_loads_as_the_gguf_does(tiny, tmp_path, tied):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = tiny_gguf(tiny, tmp_path / "m.gguf", tied)
    kw = dict(gguf_file=gguf.name)
    want = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32, **kw)
    want_tok = AutoTokenizer.from_pretrained(str(tmp_path), **kw)
    net, tok = train.load_base(gguf, torch.device("cpu"))
    assert (tmp_path / f"m.gguf.hf-{hf_copy._key(gguf)}" / "model.safetensors").exists()
    assert net.config.tie_word_embeddings == want.config.tie_word_embeddings
    got, ref = net.state_dict(), want.state_dict()
    assert list(got) == list(ref)
    for name in ref:
        assert got[name].dtype == ref[name].dtype == torch.float32
        assert torch.equal(got[name], ref[name]), name
    assert_same_tokenizer(tok, want_tok)
    assert train.assistant_opener(tok) == train.assistant_opener(want_tok)


def assert_same_tokenizer(tok, want) -> None:
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        assert ids == want(text)["input_ids"]
        assert tok.decode(ids) == want.decode(ids)
    for opener in (False, True):
        assert (tok.apply_chat_template(CHAT, add_generation_prompt=opener, tokenize=False)
                == want.apply_chat_template(CHAT, add_generation_prompt=opener, tokenize=False))
    assert tok.special_tokens_map == want.special_tokens_map
    assert (tok.eos_token_id, len(tok)) == (want.eos_token_id, len(want))


def test_a_ggufs_tokenizer_loads_from_its_copy_made_once(tiny, tmp_path, monkeypatch):
    """Tokenizer.load reads a GGUF's saved tokenizer copy, equal to transformers' tokenizer of
    the GGUF, and converts only the first time."""
    from transformers import AutoTokenizer

    gguf = tiny_gguf(tiny, tmp_path / "m.gguf")
    want = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=gguf.name)
    tok = Tokenizer.load(gguf)
    assert (tmp_path / f"m.gguf.tokenizer-{hf_copy._key(gguf)}" / "tokenizer.json").exists()
    assert_same_tokenizer(tok.hf, want)
    monkeypatch.setattr(hf_copy, "_convert_tokenizer", lambda *a: pytest.fail("converted again"))
    assert_same_tokenizer(Tokenizer.load(gguf).hf, want)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "m.gguf", f"m.gguf.tokenizer-{hf_copy._key(gguf)}"]


def test_made_once_and_again_for_a_changed_gguf(tiny, tmp_path, monkeypatch):
    gguf = tiny_gguf(tiny, tmp_path / "m.gguf")
    first = hf_copy.hf_copy(gguf)
    convert = hf_copy._convert
    with monkeypatch.context() as m:  # the copy is there: nothing converts
        m.setattr(hf_copy, "_convert", lambda *a: pytest.fail("converted again"))
        assert hf_copy.hf_copy(gguf) == first
    assert first.stat().st_mode & 0o777 == 0o755
    # A run killed while converting (its pid is gone) left a temporary folder behind.
    dead = tmp_path / f".m.gguf.hf-tmp{2**22 + 1}-x"
    dead.mkdir()
    st = gguf.stat()
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # rewritten: another key
    calls = []
    monkeypatch.setattr(hf_copy, "_convert", lambda *a: calls.append(a) or convert(*a))
    second = hf_copy.hf_copy(gguf)
    assert len(calls) == 1 and second != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", second.name]


def test_a_failed_conversion_leaves_nothing(tiny, tmp_path, monkeypatch):
    gguf = tiny_gguf(tiny, tmp_path / "m.gguf")

    def killed(gguf, folder):
        (folder / "config.json").write_text("{}")
        raise KeyboardInterrupt
    monkeypatch.setattr(hf_copy, "_convert", killed)
    with pytest.raises(KeyboardInterrupt):
        hf_copy.hf_copy(gguf)
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]


def test_a_read_only_folder_puts_the_copy_in_the_user_cache(tiny, tmp_path, monkeypatch):
    gguf = tiny_gguf(tiny, tmp_path / "m.gguf")
    monkeypatch.setattr(hf_copy.os, "access", lambda path, mode: False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = hf_copy.hf_copy(gguf)
    assert folder.parent == tmp_path / "cache" / "forkserve" / "gguf-hf"
    assert folder.name.startswith("m.gguf-") and (folder / "tokenizer.json").exists()


@needs_bfcl
def test_train_logs_the_gguf_name_and_converts_before_loading(tiny, tmp_path, monkeypatch):
    gguf = tiny_gguf(tiny, tmp_path / "m.gguf")
    convert = hf_copy._convert
    calls = []
    monkeypatch.setattr(hf_copy, "_convert", lambda *a: calls.append(a) or convert(*a))
    out = tmp_path / "adapters"
    assert train.main(["--model", str(gguf), "--out", str(out), "--device", "cpu",
                       "--categories", "simple_python", "--max-steps", "1", "--batch", "1",
                       "--distractors", "0", "--heldout", "4", "--rank", "4"]) == 0
    log = json.loads((out / "train_log.json").read_text())
    assert len(calls) == 1 and log["model"] == "m.gguf"
    assert log["convert_s"] > 0 and log["load_s"] > 0
