"""Tokenizers: the byte tokenizer of the tiny models, and a model folder's HF tokenizer, which must
encode, decode and render its chat template exactly as transformers' AutoTokenizer does; streamed
detokenization concatenates to the full decode and never emits half a character."""

from __future__ import annotations

import pytest
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_ray.model.tokenizer import ByteTokenizer, HFTokenizer

from ._checkpoint import ASSISTANT, BOS, CORPUS, EOS, USER, write_tokenizer

TEXTS = ["hello world", "  leading spaces", "東京 🙂 naïve café", "a\tb\nc", "", CORPUS[0],
         f"{USER}hi{ASSISTANT}"]
CHATS = [
    [{"role": "user", "content": "What is HiSparse?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "東京?"},
     {"role": "assistant", "content": "A city."}, {"role": "user", "content": "And 🙂?"}],
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def pair(folder):
    return HFTokenizer(folder), transformers.AutoTokenizer.from_pretrained(str(folder))


def test_hf_tokenizer_equals_transformers(pair):
    ours, hf = pair
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == hf.encode(text, add_special_tokens=special), (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert ours.encode("x")[0] == ours.bos_token_id == hf.bos_token_id
    assert ours.eos_token_ids == (hf.eos_token_id,) and hf.convert_ids_to_tokens(hf.eos_token_id) == EOS
    assert ours.vocab_size == len(hf)


def test_chat_template_equals_transformers(pair):
    ours, hf = pair
    for chat in CHATS:
        for gen in (True, False):
            text = ours.apply_chat_template(chat, add_generation_prompt=gen)
            assert text == hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            assert text.startswith(BOS) and text.endswith(ASSISTANT) == gen
            ref = hf.apply_chat_template(chat, tokenize=True, add_generation_prompt=gen)
            ref = ref["input_ids"] if isinstance(ref, dict) or hasattr(ref, "keys") else ref
            assert ours.encode_chat(chat, add_generation_prompt=gen) == list(ref)


def _streamed(tok, ids, step=1):
    s = tok.stream()
    pieces = [s.push(ids[i:i + step]) for i in range(0, len(ids), step)]
    return pieces, s.flush()


@settings(max_examples=40, deadline=None)
@given(text=st.lists(st.sampled_from(list("ab c\n東京🙂éï") + [USER]), max_size=30).map("".join),
       step=st.integers(1, 3))
def test_streaming_concatenates_to_the_full_decode(folder, text, step):
    tok = HFTokenizer(folder)
    ids = tok.encode(text)
    pieces, tail = _streamed(tok, ids, step)
    assert "".join(pieces) + tail == tok.decode(ids)
    assert not any("\ufffd" in p for p in pieces)  # never half a character


def test_byte_tokenizer():
    tok = ByteTokenizer()
    ids = tok.encode("Hi there, é")
    assert ids[:3] == [41, 74, 1] and ids[-2:] == [0, 0]  # é: two non-ASCII bytes -> 0 each
    assert tok.decode(ids) == "Hi there, ??"
    pieces, tail = _streamed(tok, ids)
    assert "".join(pieces) + tail == tok.decode(ids) and tail == ""
    assert tok.eos_token_ids == ()
    assert tok.apply_chat_template(CHATS[0]) == "user: What is HiSparse?\nassistant: "
    assert tok.encode_chat(CHATS[0]) == tok.encode("user: What is HiSparse?\nassistant: ")


def test_stop_ids_come_from_config_json_without_a_generation_config(tmp_path):
    """GLM-5 lists several end ids (``eos_token_id: [...]``) in config.json; without a
    generation_config.json transformers derives its generation config from config.json, so those
    ids stop generation too (were ignored: only the tokenizer's eos_token stopped)."""
    import json

    write_tokenizer(tmp_path)
    (tmp_path / "generation_config.json").unlink()
    eos = HFTokenizer(tmp_path).eos_token_ids
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [7, 11]}))
    assert HFTokenizer(tmp_path).eos_token_ids == tuple(sorted({*eos, 7, 11}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert HFTokenizer(tmp_path).eos_token_ids == tuple(sorted({*eos, 5}))
