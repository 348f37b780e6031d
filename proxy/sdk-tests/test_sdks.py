"""The official anthropic and openai SDKs, used as a user would, through the proxy in front of
the mock (`llm-retry-proxy --demo`). Faults are scripted per request with the x-mock-scenario
header; the mock counts the attempts it saw per x-mock-id.

Run by run.sh with PROXY_URL and MOCK_URL set.
"""

import json
import os
import sys
import time
import traceback
import urllib.request
import uuid

import anthropic
import openai

PROXY = os.environ["PROXY_URL"]
MOCK = os.environ["MOCK_URL"]
# The demo's upstreams allow 3 retries; the SDKs keep their default of 2 of their own.
PROXY_ATTEMPTS_ON_GIVE_UP = 4


def attempts(mock_id):
    with urllib.request.urlopen(f"{MOCK}/_mock/attempts/{mock_id}") as r:
        return json.load(r)["attempts"]


def headers(scenario):
    mock_id = str(uuid.uuid4())
    return mock_id, {"x-mock-scenario": scenario, "x-mock-id": mock_id}


def claude():
    return anthropic.Anthropic(api_key="demo", base_url=PROXY, timeout=30)


def gpt():
    return openai.OpenAI(api_key="demo", base_url=f"{PROXY}/v1", timeout=30)


MSG = [{"role": "user", "content": "Hello"}]


def test_anthropic_overloaded_twice():
    mock_id, h = headers("overloaded:2")
    raw = claude().messages.with_raw_response.create(
        model="claude-test", max_tokens=64, messages=MSG, extra_headers=h
    )
    msg = raw.parse()
    assert msg.content[0].text == "Hello!", msg
    assert raw.headers["x-llm-retry-attempts"] == "3"
    assert attempts(mock_id) == 3


def test_anthropic_gives_up_without_multiplying():
    mock_id, h = headers("always_overloaded")
    try:
        claude().messages.create(model="claude-test", max_tokens=64, messages=MSG, extra_headers=h)
    except anthropic.APIStatusError as e:
        assert e.status_code == 529, e
        assert e.response.headers["x-should-retry"] == "false"
    else:
        raise AssertionError("an overloaded upstream returned a message")
    # The SDK's own 2 retries would make it 12.
    assert attempts(mock_id) == PROXY_ATTEMPTS_ON_GIVE_UP, attempts(mock_id)


def test_anthropic_fallback_model():
    mock_id, h = headers("overloaded_model")
    msg = claude().messages.create(
        model="claude-primary", max_tokens=64, messages=MSG, extra_headers=h
    )
    assert msg.model == "claude-fallback", msg.model
    assert attempts(mock_id) == 4


def test_anthropic_stream_error_before_output_is_invisible():
    mock_id, h = headers("sse_error_first")
    with claude().messages.stream(
        model="claude-test", max_tokens=64, messages=MSG, extra_headers=h
    ) as stream:
        text = "".join(stream.text_stream)
    assert text == "Retried through the proxy.", text
    assert attempts(mock_id) == 2


def _anthropic_stream_raises(scenario):
    mock_id, h = headers(scenario)
    got = []
    try:
        stream = claude().messages.create(
            model="claude-test", max_tokens=64, messages=MSG, stream=True, extra_headers=h
        )
        for event in stream:
            if event.type == "content_block_delta":
                got.append(event.delta.text)
    except Exception as e:  # the SDK's APIStatusError from the error event, or a transport error
        assert "".join(got) == "Retried through ", got
        assert attempts(mock_id) == 1
        return type(e).__name__
    raise AssertionError(f"{scenario}: a cut stream looked complete: {got}")


def test_anthropic_cut_after_output_raises():
    return _anthropic_stream_raises("cut_after_output")


def test_anthropic_clean_cut_after_output_raises():
    return _anthropic_stream_raises("clean_cut_after_output")


def test_anthropic_resumed_stream_is_one_whole_message():
    # The upstream under /anthropic-resume resumes a cut stream with a prefill.
    mock_id, h = headers("cut_then_rest")
    client = anthropic.Anthropic(api_key="demo", base_url=f"{PROXY}/anthropic-resume", timeout=30)
    with client.messages.stream(
        model="claude-test", max_tokens=64, messages=MSG, extra_headers=h
    ) as stream:
        text = "".join(stream.text_stream)
        message = stream.get_final_message()
    assert text == "Retried through the proxy.", text
    assert len(message.content) == 1, message.content
    assert message.content[0].text == "Retried through the proxy.", message
    assert message.stop_reason == "end_turn", message
    # Both streams' usage: 10 + 10 input tokens, 1 + 2 output tokens.
    assert (message.usage.input_tokens, message.usage.output_tokens) == (20, 3), message.usage
    assert attempts(mock_id) == 2


def test_openai_resumed_stream_is_one_whole_completion():
    mock_id, h = headers("cut_then_rest")
    client = openai.OpenAI(api_key="demo", base_url=f"{PROXY}/openai-resume/v1", timeout=30)
    stream = client.chat.completions.create(
        model="gpt-test", messages=MSG, stream=True, extra_headers=h
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Retried through the proxy.", text
    assert {c.id for c in chunks} == {chunks[0].id}, [c.id for c in chunks]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert attempts(mock_id) == 2


def test_openai_rate_limited_twice():
    mock_id, h = headers("rate_limited:2")
    chat = gpt().chat.completions.create(model="gpt-test", messages=MSG, extra_headers=h)
    assert chat.choices[0].message.content, chat
    assert attempts(mock_id) == 3


def test_openai_gives_up_without_multiplying():
    mock_id, h = headers("always_overloaded")
    try:
        gpt().chat.completions.create(model="gpt-test", messages=MSG, extra_headers=h)
    except openai.InternalServerError as e:
        assert e.response.headers["x-should-retry"] == "false"
    else:
        raise AssertionError("a failing upstream returned a completion")
    assert attempts(mock_id) == PROXY_ATTEMPTS_ON_GIVE_UP, attempts(mock_id)


def test_openai_stream_after_reset():
    mock_id, h = headers("reset_first")
    stream = gpt().chat.completions.create(
        model="gpt-test", messages=MSG, stream=True, extra_headers=h
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == "Retried through the proxy.", text
    assert attempts(mock_id) == 2


def _openai_stream_raises(scenario):
    mock_id, h = headers(scenario)
    got = []
    try:
        stream = gpt().chat.completions.create(
            model="gpt-test", messages=MSG, stream=True, extra_headers=h
        )
        for chunk in stream:
            if chunk.choices:
                got.append(chunk.choices[0].delta.content or "")
    except Exception as e:
        assert "".join(got) == "Retried through ", got
        assert attempts(mock_id) == 1
        return type(e).__name__
    raise AssertionError(f"{scenario}: a cut stream looked complete: {got}")


def test_openai_cut_after_output_raises():
    return _openai_stream_raises("cut_after_output")


def test_openai_clean_cut_after_output_raises():
    return _openai_stream_raises("clean_cut_after_output")


# The client deadline: an SDK that waits SDK_TIMEOUT seconds against an upstream whose every
# attempt answers 503 after SLOW_MS. The demo's loop (4 attempts, about 4.7 s) would outlast the
# SDK, which would time out and retry the proxy; bounded by the timeout the SDK advertises
# (x-stainless-read-timeout; 4 s less the 1 s margin) the proxy answers at 3 s, after 3
# attempts, with x-should-retry: false, and the SDK raises without a retry of its own.
SDK_TIMEOUT = 4
SLOW_MS = 1000
ATTEMPTS_WITHIN_DEADLINE = 3


def _raises_within_its_timeout(call, status_error):
    mock_id, h = headers(f"slow_unavailable:{SLOW_MS}")
    start = time.monotonic()
    try:
        call(h)
    except status_error as e:
        took = time.monotonic() - start
        assert e.status_code in (502, 503), e
        assert e.response.headers["x-should-retry"] == "false", e.response.headers
        proxy_attempts = int(e.response.headers["x-llm-retry-attempts"])
    else:
        raise AssertionError("an unavailable upstream returned an answer")
    # One request from the SDK: the mock saw the proxy's attempts of it and no more.
    assert proxy_attempts == ATTEMPTS_WITHIN_DEADLINE, proxy_attempts
    assert attempts(mock_id) == proxy_attempts, (attempts(mock_id), proxy_attempts)
    assert took < SDK_TIMEOUT, took
    return f"{took:.2f} s, {proxy_attempts} attempts"


def test_anthropic_timeout_bounds_the_proxys_loop():
    client = anthropic.Anthropic(api_key="demo", base_url=PROXY, timeout=SDK_TIMEOUT)
    return _raises_within_its_timeout(
        lambda h: client.messages.create(
            model="claude-test", max_tokens=64, messages=MSG, extra_headers=h
        ),
        anthropic.APIStatusError,
    )


def test_openai_timeout_bounds_the_proxys_loop():
    client = openai.OpenAI(
        api_key="demo", base_url=f"{PROXY}/v1", timeout=SDK_TIMEOUT, max_retries=2
    )
    return _raises_within_its_timeout(
        lambda h: client.chat.completions.create(model="gpt-test", messages=MSG, extra_headers=h),
        openai.APIStatusError,
    )


def main():
    tests = [(n, f) for n, f in sorted(globals().items()) if n.startswith("test_")]
    failed = 0
    print(f"anthropic {anthropic.__version__}, openai {openai.__version__}")
    for name, f in tests:
        try:
            out = f()
            print(f"ok    {name}" + (f" ({out})" if out else ""))
        except Exception:
            failed += 1
            print(f"FAIL  {name}")
            traceback.print_exc()
    print(f"{len(tests) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
