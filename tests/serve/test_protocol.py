"""The OpenAI protocol layer without a server: strict parsing names the bad parameter, every
unsupported parameter that would change the output is refused, stop strings are found across
chunk boundaries and never emitted, errors map to OpenAI bodies and statuses."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_ray.errors import (
    CapacityError, ConfigError, InvalidRequestError, StateError, TransferError,
)
from hisparse_ray.serve.protocol import (
    ApiError, ChatRequest, CompletionRequest, StopStrings, api_error, parse,
)
from hisparse_ray.serve.server import check_text


def _parse(model, body) -> object:
    return parse(model, json.dumps(body).encode() if not isinstance(body, bytes) else body)


@pytest.mark.parametrize("body, param", [
    (b"{nope", None), (b"[1, 2]", None), ({"prompt": "x"}, "model"),
    (b"[" * 100_000, None), (b'{"model": "m", "prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
                            None),  # nested past the JSON parser's recursion limit: 400, not 500
    ({"model": "m", "prompt": "x", "temperature": "0.5"}, "temperature"),
    ({"model": "m", "prompt": "x", "temperature": -1}, "temperature"),
    ({"model": "m", "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": "m", "prompt": "x", "top_k": -2}, "top_k"),
    ({"model": "m", "prompt": "x", "seed": -1}, "seed"),
    ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"model": "m", "prompt": "x", "n": 0}, "n"),
    ({"model": "m", "prompt": "x", "n": 65}, "n"),
    ({"model": "m", "prompt": ["x"] * 33, "n": 2}, "n"),
    ({"model": "m", "prompt": [[1]] * 65}, "prompt"),
    ({"model": "m", "prompt": ["x", ""]}, "prompt"),
    ({"model": "m", "prompt": [[1], []]}, "prompt"),
    ({"model": "m", "prompt": "x", "logprobs": 3}, "logprobs"),
    ({"model": "m", "prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
    ({"model": "m", "prompt": "x", "logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"model": "m", "prompt": "x", "repetition_penalty": 1.1}, "repetition_penalty"),
    ({"model": "m", "prompt": "x", "min_p": 0.05}, "min_p"),
    ({"model": "m", "prompt": "x", "min_tokens": 3}, "min_tokens"),
    ({"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"model": "m", "prompt": "x", "bogus": 1}, "bogus"),
    ({"model": "m", "prompt": "x", "stop": ["a"] * 17}, "stop"),
    (b'{"model": "m", "prompt": "x", "temperature": Infinity}', "temperature"),
    (b'{"model": "m", "prompt": "x", "temperature": NaN}', "temperature"),
    (b'{"model": "m", "prompt": "x", "top_p": NaN}', "top_p"),
    (b'{"model": "m", "prompt": "x", "presence_penalty": -Infinity}', "presence_penalty"),
    ({"model": "m", "prompt": "x", "max_tokens": 10**9}, "max_tokens"),  # past the limit
])
def test_bad_completion_requests_name_the_parameter(body, param):
    with pytest.raises(ApiError) as info:
        req = _parse(CompletionRequest, body)
        req.stop_strings()
        req.new_tokens(4096)
        req.prompts()
    assert info.value.status == 400 and info.value.param == param
    assert set(info.value.body()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"a": 1}]}, "tools"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}],
      "response_format": {"type": "json_object"}}, "response_format"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4097},
     "max_tokens"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5,
      "max_completion_tokens": 4097}, "max_completion_tokens"),
])
def test_bad_chat_requests_name_the_parameter(body, param):
    with pytest.raises(ApiError) as info:
        _parse(ChatRequest, body).new_tokens(4096)
    assert info.value.status == 400 and info.value.param == param


def test_good_requests_and_their_engine_arguments():
    req = _parse(CompletionRequest, {"model": "m", "prompt": [[3, 4, 5]], "max_tokens": 4,
                                     "seed": 7, "top_k": -1, "stop": "x", "n": 1, "user": "u"})
    assert req.prompts() == [[3, 4, 5]] and req.stop_strings() == ["x"]
    args = req.engine_args(req.max_tokens)
    assert args == {"max_new_tokens": 4, "temperature": 1.0, "top_p": None, "top_k": -1,
                    "seed": 7}  # OpenAI's default temperature is 1
    chat = _parse(ChatRequest, {"model": "m", "temperature": 0, "max_completion_tokens": 3,
                                "messages": [{"role": "user", "content": [
                                    {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert [m.as_dict() for m in chat.messages] == [{"role": "user", "content": "ab"}]
    tool = _parse(ChatRequest, {"model": "m", "messages": [  # a "tool" message needs its id
        {"role": "user", "content": "x"}, {"role": "tool", "content": "42", "tool_call_id": "c1"}]})
    assert tool.messages[1].as_dict() == {"role": "tool", "content": "42", "tool_call_id": "c1"}
    assert chat.new_tokens(3) == 3 and req.new_tokens(4) == 4
    both = _parse(ChatRequest, {"model": "m", "max_tokens": 9, "max_completion_tokens": 2,
                                "messages": [{"role": "user", "content": "x"}]})
    assert both.new_tokens(4) == 2  # max_completion_tokens wins (max_tokens: its old name)
    assert _parse(ChatRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}]}
                  ).new_tokens(4) is None  # the server's default
    assert _parse(CompletionRequest, {"model": "m", "prompt": "x", "echo": True}).echo
    batch = _parse(CompletionRequest, {"model": "m", "prompt": ["a", "b"], "n": 3, "seed": 5})
    assert batch.prompts() == ["a", "b"]  # a batch: each prompt gets n choices
    assert [batch.engine_args(4, j)["seed"] for j in range(3)] == [5, 6, 7]  # n choices differ
    assert _parse(CompletionRequest, {"model": "m", "prompt": [[1, 2], [3]]}).prompts() == \
        [[1, 2], [3]]
    assert _parse(CompletionRequest, {"model": "m", "prompt": "x", "seed": 2**63 - 1}
                  ).engine_args(4, 1)["seed"] == 0  # wraps inside the seed range
    assert _parse(CompletionRequest, {"model": "m", "prompt": "x", "n": 2}
                  ).engine_args(4, 1)["seed"] is None  # unseeded: each its own random seed


def test_null_parameters_mean_not_given():
    """OpenAI's optional parameters are nullable: clients send ``"n": null``, ``"stream": null``
    for what they leave unset; those are the defaults, not type errors."""
    nulls = {k: None for k in ("n", "stream", "echo", "ignore_eos", "best_of", "suffix",
                               "logprobs", "max_tokens", "temperature", "stop", "seed", "user",
                               "presence_penalty", "frequency_penalty", "logit_bias", "top_p",
                               "repetition_penalty", "min_p", "min_tokens")}
    req = _parse(CompletionRequest, {"model": "m", "prompt": "x", **nulls})
    assert (req.n, req.stream, req.echo, req.ignore_eos) == (1, False, False, False)
    assert req.engine_args(req.max_tokens)["temperature"] == 1.0
    chat = _parse(ChatRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                "n": None, "stream": True, "max_completion_tokens": None,
                                "stream_options": {"include_usage": None}, "tools": None,
                                "tool_choice": None, "response_format": None})
    assert chat.stream and chat.stream_options.include_usage is False
    with pytest.raises(ApiError) as info:  # a required parameter stays required
        _parse(CompletionRequest, {"model": None, "prompt": "x"})
    assert info.value.param == "model"


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="abcEND", max_size=40), stops=st.lists(
    st.text(alphabet="abcEND", min_size=1, max_size=4), min_size=0, max_size=3),
    seed=st.integers(0, 1000))
def test_stop_strings_cut_at_the_first_match_whatever_the_chunks(text, stops, seed):
    """Streamed in random pieces, the emitted text ends right before the stop string that
    completes first (reading the text character by character), or is all of it."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    s = StopStrings(stops)
    out, hit = "", False
    for p in pieces:
        emit, hit = s.push(p)
        out += emit
        if hit:
            break
    if not hit:
        out += s.flush()
    for end in range(len(text) + 1):  # the reference: one character at a time
        done = [end - len(x) for x in stops if text[:end].endswith(x)]
        if done:
            assert (out, hit) == (text[:min(done)], True)
            return
    assert (out, hit) == (text, False)


def test_errors_map_to_statuses_and_bodies():
    from ray.serve.exceptions import BackPressureError

    cases = [(CapacityError("prompt tokens", 9, 4), 413), (InvalidRequestError("-", "bad"), 400),
             (ConfigError("top_p", 2, "in (0, 1]"), 400), (StateError("replica failed"), 503),
             (TransferError("x"), 503), (TimeoutError("late"), 504),
             (BackPressureError(num_queued_requests=1, max_queued_requests=1), 429)]
    for err, status in cases:
        api = api_error(err)
        assert api.status == status and api.body()["error"]["message"]
    assert api_error(InvalidRequestError("-", "bad")).message == "bad"  # not "invalid request '-'"
    assert api_error(ConfigError("top_p", 2, "in (0, 1]")).param == "top_p"
    assert api_error(KeyError("bug")) is None  # a bug stays a 500 with its traceback


def test_text_is_checked_before_tokenizing():
    assert check_text("prompt", "hello", 4) == "hello"
    with pytest.raises(InvalidRequestError, match="index 1"):
        check_text("prompt", "a\ud800b", 4)
    with pytest.raises(CapacityError):
        check_text("prompt", "x" * (4 * 64 + 1), 4)


def test_prometheus_texts_of_several_nodes_merge_into_one_valid_exposition():
    """``GET /metrics`` merges every node's export: one HELP / TYPE per family (a family twice
    is refused by Prometheus' parser), every node's samples under it, other families left out."""
    from hisparse_ray.serve.openai_api import merge_prometheus

    def node(n: int) -> str:
        return (f"# HELP ray_other_x other\n# TYPE ray_other_x counter\nray_other_x 1\n"
                f"# HELP ray_hisparse_tokens_total tokens\n"
                f"# TYPE ray_hisparse_tokens_total counter\n"
                f'ray_hisparse_tokens_total{{replica="{n}"}} {n}.0\n'
                f"# HELP ray_hisparse_ttft_seconds ttft\n"
                f"# TYPE ray_hisparse_ttft_seconds histogram\n"
                f'ray_hisparse_ttft_seconds_bucket{{le="1.0",replica="{n}"}} {n}.0\n'
                f'ray_hisparse_ttft_seconds_count{{replica="{n}"}} {n}.0\n')

    text = merge_prometheus([node(1), node(2)], "ray_hisparse_")
    lines = text.splitlines()
    assert text.endswith("\n") and not any("ray_other" in x for x in lines)
    for fam in ("ray_hisparse_tokens_total", "ray_hisparse_ttft_seconds"):
        assert sum(x.startswith(f"# TYPE {fam} ") for x in lines) == 1
        assert sum(x.startswith(f"# HELP {fam} ") for x in lines) == 1
    assert lines[:4] == ["# HELP ray_hisparse_tokens_total tokens",
                         "# TYPE ray_hisparse_tokens_total counter",
                         'ray_hisparse_tokens_total{replica="1"} 1.0',
                         'ray_hisparse_tokens_total{replica="2"} 2.0']
    assert lines[4:] == ["# HELP ray_hisparse_ttft_seconds ttft",
                         "# TYPE ray_hisparse_ttft_seconds histogram",
                         'ray_hisparse_ttft_seconds_bucket{le="1.0",replica="1"} 1.0',
                         'ray_hisparse_ttft_seconds_count{replica="1"} 1.0',
                         'ray_hisparse_ttft_seconds_bucket{le="1.0",replica="2"} 2.0',
                         'ray_hisparse_ttft_seconds_count{replica="2"} 2.0']
    assert merge_prometheus([], "ray_hisparse_") == ""


def test_a_chat_template_that_refuses_the_messages_is_a_400():
    """Real chat templates refuse conversations (Mistral's: roles must alternate) with
    ``raise_exception``; that is the client's error (400 naming ``messages``), not a 500. A
    template that does not compile stays a server error."""
    from jinja2.exceptions import TemplateSyntaxError

    from hisparse_ray.model.tokenizer import ByteTokenizer, _render
    from hisparse_ray.serve.openai_api import chat_ids

    class Templated(ByteTokenizer):
        template = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0)"
                    " %}{{ raise_exception('Conversation roles must alternate user/assistant') }}"
                    "{% endif %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")

        def apply_chat_template(self, messages, *, add_generation_prompt=True, **kwargs):
            return _render(self.template, messages=list(messages))

    tok = Templated()
    ok = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert chat_ids(tok, ok) == tok.encode("user: a\nassistant: b\n", add_special_tokens=False)
    with pytest.raises(ApiError) as info:
        chat_ids(tok, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert info.value.status == 400 and info.value.param == "messages"
    assert "alternate" in info.value.message
    tok.template = "{% for m in messages %}"
    with pytest.raises(TemplateSyntaxError):
        chat_ids(tok, ok)


def test_vllm_sampling_extras_at_their_neutral_values_are_taken():
    """vLLM clients send ``repetition_penalty: 1.0``, ``min_p: 0``, ``min_tokens: 0`` (the
    defaults of its SamplingParams) on every request; those change nothing and are taken, on
    both endpoints, instead of a 400 'unknown parameter'."""
    extras = {"repetition_penalty": 1.0, "min_p": 0.0, "min_tokens": 0}
    req = _parse(CompletionRequest, {"model": "m", "prompt": "x", "temperature": 0, **extras})
    req.check_supported()
    assert req.engine_args(4)["temperature"] == 0.0
    chat = _parse(ChatRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                **extras})
    chat.check_supported()


def test_a_choice_text_ends_at_its_stop_string_and_reports_its_tokens():
    """``ChoiceText`` (the HiSparse deployment's side of a choice): decode-step items become
    text, a stop string ends the choice before it (finish "stop"), the done item gives the
    finish reason and the completion tokens; without a tokenizer the text is empty."""
    from hisparse_ray.model.tokenizer import ByteTokenizer
    from hisparse_ray.serve.server import ChoiceText

    tok = ByteTokenizer()
    text = ChoiceText(tok, ["cd"])
    assert text.push({"tokens": tok.encode("abc")}) == ("ab", None)  # "c" may begin "cd"
    # the count ends at the token completing the stop string ("d", the 4th), not the chunk's
    # end: a chunk holds as many decode steps as the event poll gathered (it was 6 here)
    assert text.push({"tokens": tok.encode("dxy")}) == ("", "stop") and text.tokens == 4
    text = ChoiceText(tok, ["b", "zz"])
    assert text.push({"tokens": tok.encode("abcd")}) == ("a", "stop") and text.tokens == 2
    for reason, fin in (("length", "length"), ("eos", "stop"), ("stop", "stop")):
        text = ChoiceText(tok, [])
        assert text.push({"tokens": tok.encode("hi!")}) == ("hi!", None)
        done = {"done": True, "tokens": tok.encode("hi!"), "finish_reason": reason}
        assert text.push(done) == ("", fin) and text.tokens == 3
    text = ChoiceText(None, ["x"])
    assert text.push({"tokens": [5, 6]}) == ("", None) and text.tokens == 2
    with pytest.raises(StateError, match="aborted on the replica after 2 tokens"):
        # an abort by someone else (an operator): cut short, not a "length" answer
        ChoiceText(tok, []).push({"done": True, "tokens": [5, 6], "finish_reason": "abort"})
