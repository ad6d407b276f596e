"""``app.serve.protocol``: request validation and OpenAI's response and chunk formats."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from pydantic import ValidationError

from app.serve.protocol import (
    SSE_DONE,
    ApiError,
    ChatRequest,
    CompletionRequest,
    Reply,
    Sampling,
    TokenLogprob,
    chat_logprobs,
    chat_messages,
    completion_logprobs,
    new_completion_id,
    prompt_of,
    request_record,
    sampling_of,
    sse,
    usage,
)


def completion(**kw: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "p"} | kw)


def chat(**kw: Any) -> ChatRequest:
    return ChatRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]} | kw
    )


def test_sampling_defaults() -> None:
    assert sampling_of(completion(), 256, 16) == Sampling(max_tokens=256)


def test_sampling_takes_every_openai_knob() -> None:
    s = sampling_of(
        completion(max_tokens=9, temperature=0, top_p=0.5, n=3, stop="\n", seed=4), 256, 16
    )
    assert s == Sampling(9, 0.0, 0.5, 3, ("\n",), 4)


def test_chat_prefers_max_completion_tokens() -> None:
    assert sampling_of(chat(max_tokens=5, max_completion_tokens=7), 256, 16).max_tokens == 7
    assert sampling_of(chat(max_tokens=5), 256, 16).max_tokens == 5


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"n": 17}, "n"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": -1}, "frequency_penalty"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"echo": True}, "echo"),
        ({"suffix": "x"}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"logprobs": 21}, "logprobs"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata"),
    ],
)
def test_completion_requests_refused(kw: dict[str, Any], param: str) -> None:
    with pytest.raises((ApiError, ValidationError)) as e:
        sampling_of(completion(**kw), 256, 16)
    err = e.value
    if isinstance(err, ValidationError):  # the app answers these 400 too
        assert err.errors()[0]["loc"][0] == param
        return
    assert isinstance(err, ApiError) and err.status == 400 and err.param == param
    assert err.body()["error"]["type"] == "invalid_request_error"


def test_defaults_a_client_sends_are_accepted() -> None:
    """Zero penalties, an empty logit_bias, best_of = n, unknown fields: fine."""
    req = completion(
        presence_penalty=0, frequency_penalty=0, logit_bias={}, best_of=1, future_field=1
    )
    assert sampling_of(req, 256, 16).n == 1


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": {"name": "f"}}, "function_call"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
        ({"audio": {"voice": "x"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({"web_search_options": {}}, "web_search_options"),
    ],
)
def test_chat_requests_refused(kw: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as e:
        sampling_of(chat(**kw), 256, 16)
    assert e.value.param == param
    if param != "top_logprobs":
        assert e.value.code == "unsupported_parameter"


def test_what_asks_for_nothing_is_accepted() -> None:
    req = chat(tool_choice="none", response_format={"type": "text"}, modalities=["text"])
    assert sampling_of(req, 256, 16).logprobs is None


@pytest.mark.parametrize(
    ("kw", "logprobs"),
    [({}, None), ({"logprobs": False, "top_logprobs": 0}, None), ({"logprobs": True}, 0)]
    + [({"logprobs": True, "top_logprobs": 5}, 5)],
)
def test_chat_logprobs(kw: dict[str, Any], logprobs: int | None) -> None:
    assert sampling_of(chat(**kw), 256, 16).logprobs == logprobs


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"user": "u" * 257}, "user"),
        ({"model": "m" * 257}, "model"),
        ({"seed": 2**63}, "seed"),
        ({"max_tokens": 2**31}, "max_tokens"),
        ({"logprobs": -1}, "logprobs"),
    ],
)
def test_oversized_fields_are_refused_before_anything_runs(kw: dict[str, Any], param: str) -> None:
    """An unbounded field (a 1.1 MB ``user``, a 10**30 ``max_tokens``) once made a record the
    broker refuses, or a request record orjson cannot write, on the engine thread."""
    with pytest.raises(ValidationError) as e:
        completion(**kw)
    assert e.value.errors()[0]["loc"][0] == param


def test_a_long_stop_string_is_refused() -> None:
    with pytest.raises(ApiError) as e:
        sampling_of(completion(stop=["x" * 257]), 256, 16)
    assert e.value.param == "stop"
    assert sampling_of(completion(stop=["x" * 256]), 256, 16).stop == ("x" * 256,)


def test_too_many_messages_are_refused() -> None:
    with pytest.raises(ValidationError):
        chat(messages=[{"role": "user", "content": "x"}] * 1025)


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("hi", "hi"), (["hi"], "hi"), ([5, 6], [5, 6]), ([[5, 6]], [5, 6])],
)
def test_prompt_forms(prompt: Any, expected: Any) -> None:
    assert prompt_of(completion(prompt=prompt)) == expected


@pytest.mark.parametrize("prompt", [["a", "b"], [[1], [2]]])
def test_one_prompt_per_request(prompt: Any) -> None:
    with pytest.raises(ApiError) as e:
        prompt_of(completion(prompt=prompt))
    assert e.value.param == "prompt"


def test_chat_messages_flatten_text_parts_and_refuse_images() -> None:
    req = chat(
        messages=[
            {"role": "system", "content": None},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ]
    )
    assert chat_messages(req) == [
        {"role": "system", "content": ""},
        {"role": "user", "content": "ab"},
    ]
    with pytest.raises(ApiError):
        chat_messages(chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]))


def test_request_record_keeps_what_the_application_asked() -> None:
    req = completion(max_tokens=3, user="u1", metadata={"k": "v"}, stream=True)
    rec = request_record(req, "completion", sampling_of(req, 256, 16))
    assert rec == {
        "endpoint": "completions",
        "model": "m",
        "max_tokens": 3,
        "temperature": 1.0,
        "top_p": 1.0,
        "n": 1,
        "stop": [],
        "seed": None,
        "logprobs": None,
        "stream": True,
        "user": "u1",
        "metadata": {"k": "v"},
    }


def test_completion_body() -> None:
    r = Reply("completion", "cmpl-1", 10, "m")
    body = r.body([("a", "stop", None), ("b", "length", None)], usage(3, 4), "srl-hf-v2")
    assert body == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 10,
        "model": "m",
        "system_fingerprint": "srl-hf-v2",
        "choices": [
            {"index": 0, "text": "a", "logprobs": None, "finish_reason": "stop"},
            {"index": 1, "text": "b", "logprobs": None, "finish_reason": "length"},
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
    }


def test_chat_body_and_chunks() -> None:
    r = Reply("chat", "chatcmpl-1", 10, "m")
    body = r.body([("hi", "stop", None)], usage(1, 1), "fp")
    assert body["object"] == "chat.completion"
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "hi"},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    opening = r.chunk(0, "", None, "fp", role=True)
    assert opening["object"] == "chat.completion.chunk"
    assert opening["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    assert r.chunk(1, "x", None, "fp")["choices"][0]["delta"] == {"content": "x"}
    last = r.chunk(1, "", "length", "fp")["choices"][0]
    assert last["delta"] == {} and last["finish_reason"] == "length"
    assert r.usage_chunk(usage(1, 2), "fp")["choices"] == []


def test_completion_chunk_and_sse_framing() -> None:
    r = Reply("completion", "cmpl-1", 10, "m")
    event = sse(r.chunk(2, "x", "stop", "fp"))
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert orjson.loads(event[6:])["choices"] == [
        {"index": 2, "text": "x", "logprobs": None, "finish_reason": "stop"}
    ]
    assert SSE_DONE == b"data: [DONE]\n\n"


def test_completion_ids() -> None:
    assert new_completion_id("completion").startswith("cmpl-")
    assert new_completion_id("chat").startswith("chatcmpl-")
    assert new_completion_id("chat") != new_completion_id("chat")


TOKENS = [TokenLogprob("a", -0.5, (("a", -0.5), ("b", -1.5))), TokenLogprob("bc", -2.0, ())]


def test_completion_logprobs_are_vllms_legacy_shape() -> None:
    """The sampled token and its alternatives in one dict; offsets count the token texts."""
    assert completion_logprobs(TOKENS, offset=3) == {
        "tokens": ["a", "bc"],
        "token_logprobs": [-0.5, -2.0],
        "top_logprobs": [{"a": -0.5, "b": -1.5}, {"bc": -2.0}],
        "text_offset": [3, 4],
    }


def test_chat_logprobs_carry_bytes_and_alternatives() -> None:
    out = chat_logprobs([TokenLogprob("é", float("-inf"), (("é", -1.0),))])
    assert out == {
        "content": [
            {
                "token": "é",
                "logprob": -9999.0,
                "bytes": [195, 169],
                "top_logprobs": [{"token": "é", "logprob": -1.0, "bytes": [195, 169]}],
            }
        ],
        "refusal": None,
    }


def test_retry_after_and_authenticate_headers() -> None:
    assert ApiError(429, "busy", retry_after_s=1).headers == {"Retry-After": "1"}
    assert ApiError(401, "key").headers == {"WWW-Authenticate": "Bearer"}
    assert ApiError(400, "bad").headers == {}
