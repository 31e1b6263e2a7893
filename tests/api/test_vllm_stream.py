"""Reading a vLLM chat stream (``api.engine.vllm_stream``): what each chunk adds, and the
whole reply the stream adds up to, checked as a non-streamed reply is."""

from __future__ import annotations

from api.engine import vllm
from api.engine.http import sse_data
from api.engine.vllm_stream import StreamedChat, finished


def chunk(delta: dict, ids: list[int], **extra: object) -> dict:
    logprobs = {"content": [{"token": f"token_id:{i}", "logprob": -0.5} for i in ids]}
    choice = {"index": 0, "delta": delta, "logprobs": logprobs, "token_ids": ids}
    return {"choices": [{**choice, **extra}]}


def stream_of_a_tool_call() -> StreamedChat:
    stream = StreamedChat()
    stream.add(
        {"prompt_token_ids": [1, 2, 3], "choices": [{"index": 0, "delta": {"role": "assistant"}}]}
    )
    assert stream.add(chunk({"reasoning_content": "think"}, [10])).reasoning == "think"
    assert stream.add(chunk({"content": "Hi"}, [11])).text == "Hi"
    assert not stream.add(chunk({}, [12, 13]))  # a parser held these ids' text back
    first = stream.add(
        chunk(
            {"tool_calls": [{"index": 0, "function": {"name": "Bash", "arguments": '{"a"'}}]}, [14]
        )
    )
    later = stream.add(
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}, [15])
    )
    stream.add(chunk({}, [16], finish_reason="tool_calls"))
    stream.add({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 7}})
    (piece,) = first.tool_calls
    assert piece["id"].startswith("call_") and piece["name"] == "Bash"  # no id sent: one made
    assert later.tool_calls[0]["id"] is None and later.tool_calls[0]["arguments"] == ": 1}"
    return stream


def test_a_stream_adds_up_to_the_whole_reply_with_every_id() -> None:
    stream = stream_of_a_tool_call()
    assert finished(stream) is None
    generation = vllm.read_chat(stream.response())
    assert generation.ids_problem is None
    assert generation.prompt_token_ids == [1, 2, 3]
    assert generation.generation_token_ids == [10, 11, 12, 13, 14, 15, 16]
    assert generation.text == "Hi" and generation.reasoning == "think"
    (call,) = generation.tool_calls
    assert call["function"] == {"name": "Bash", "arguments": '{"a": 1}'}


def test_a_stream_that_lost_ids_or_its_usage_is_not_trusted() -> None:
    stream = stream_of_a_tool_call()
    stream.usage = {"prompt_tokens": 3, "completion_tokens": 9}  # the engine made 9
    assert "usage.completion_tokens" in vllm.read_chat(stream.response()).ids_problem
    silent = stream_of_a_tool_call()
    silent.usage = None
    assert "usage chunk" in finished(silent)
    broken = StreamedChat()
    broken.add(["not", "an", "object"])
    assert "not a JSON object" in finished(broken)


def test_sse_lines() -> None:
    assert sse_data(b'data: {"a": 1}\n') == '{"a": 1}'
    assert sse_data(b": keep-alive\n") is None and sse_data(b"\n") is None
