"""Request logs as JSON lines: streaming by byte offset and recognising each line's format."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

try:  # parses lines of token ids about 1.7 times as fast; used when installed
    import orjson as _orjson

    _loads = _orjson.loads
    _JSONError: tuple[type[Exception], ...] = (_orjson.JSONDecodeError, UnicodeDecodeError, RecursionError)
except ImportError:  # pragma: no cover - depends on the environment
    _loads = json.loads
    _JSONError = (json.JSONDecodeError, UnicodeDecodeError, RecursionError)  # RecursionError: nested too deeply

logger = logging.getLogger(__name__)

TOKENS, TEXT, CHAT = "tokens", "text", "chat"
"""Kinds of log line: token ids, prompt and completion text, or chat messages and the answer."""

_ANSWER_KEYS = ("response", "completion", "output")
_ID_KEYS = ("request_id", "id", "custom_id")


class MalformedLine(ValueError):
    """A log line that cannot be read as a completed request; the message says why."""


@dataclass(slots=True)
class LogRequest:
    """One completed request read from a log line.

    Attributes:
        line_no: 1-based line number in its file.
        kind: TOKENS, TEXT or CHAT.
        request_id: the line's ``request_id`` / ``id`` / ``custom_id``, or "".
        prompt: token ids (TOKENS), prompt text (TEXT) or None (CHAT: rendered from ``messages``).
        output: token ids (TOKENS) or the answer text (TEXT, CHAT).
        messages: CHAT only: the conversation before the answer.
    """

    line_no: int
    kind: str
    request_id: str
    prompt: list | str | None
    output: list | str
    messages: list[dict] | None = None

    def size_hint(self) -> int:
        """Roughly how many tokens the request holds (text: about 4 characters per token)."""
        if self.kind == TOKENS:
            return len(self.prompt) + len(self.output)  # type: ignore[arg-type]
        chars = len(self.output) + (len(self.prompt) if isinstance(self.prompt, str) else 0)
        for m in self.messages or ():
            chars += len(m.get("content") or "")
        return chars // 4 + 1


def iter_lines(f: BinaryIO, offset: int = 0, line_no: int = 0, take_unterminated: bool = True
               ) -> Iterator[tuple[int, int, bytes]]:
    """Yield (line number, byte offset just after the line, line bytes) from ``offset`` of a binary file.

    Reads one line at a time, so memory does not depend on the file's size. ``line_no`` is the number of
    lines before ``offset``. A last line without a newline is yielded only with ``take_unterminated`` (a
    writer may still be appending to it).
    """
    f.seek(offset)
    for raw in f:
        if not raw.endswith(b"\n") and not take_unterminated:
            return
        line_no += 1
        offset += len(raw)
        yield line_no, offset, raw


def parse_line(raw: bytes, line_no: int) -> LogRequest | None:
    """The request a log line holds, or None for a blank line.

    Recognised (first match wins):
        ``prompt`` and ``output`` lists of token ids (a missing one is empty);
        ``messages`` ([{role, content}, ...]) at the top or under ``request`` / ``request.body``, answered by
        ``response`` / ``completion`` / ``output`` text, an OpenAI response object (``choices[0].message
        .content``, also under ``response`` / ``response.body``), or else a final assistant message;
        ``prompt`` text with ``completion`` / ``output`` / ``response`` text.

    Raises:
        MalformedLine: not JSON, not an object, or none of the above.
    """
    if not raw.strip():
        return None
    try:
        obj = _loads(raw)
    except _JSONError as exc:
        raise MalformedLine(f"not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise MalformedLine(f"a JSON object was expected, got {type(obj).__name__}")
    rid = next((obj[k] for k in _ID_KEYS if isinstance(obj.get(k), (str, int)) and obj.get(k) != ""), "")
    request_id = str(rid) if not isinstance(rid, bool) else ""
    prompt, output = obj.get("prompt"), obj.get("output")
    if isinstance(prompt, list) or isinstance(output, list):
        prompt, output = ([] if prompt is None else prompt), ([] if output is None else output)
        if not isinstance(prompt, list) or not isinstance(output, list):
            raise MalformedLine("token ids need 'prompt' and 'output' as lists of integers")
        return LogRequest(line_no, TOKENS, request_id, prompt, output)
    messages = _messages(obj)
    if messages is not None:
        answer = _answer(obj)
        if answer is None:
            if messages and messages[-1]["role"] == "assistant":
                messages, answer = messages[:-1], messages[-1]["content"]
            else:
                raise MalformedLine("chat 'messages' without an answer: give 'response' or 'completion' text, "
                                    "OpenAI 'choices', or end the messages with the assistant's")
        if not messages:
            raise MalformedLine("no messages before the answer")
        return LogRequest(line_no, CHAT, request_id, None, answer, messages)
    if isinstance(prompt, str):
        answer = next((obj[k] for k in ("completion", "output", "response") if isinstance(obj.get(k), str)), None)
        if answer is None:
            raise MalformedLine("text 'prompt' without 'completion', 'output' or 'response' text")
        return LogRequest(line_no, TEXT, request_id, prompt, answer)
    raise MalformedLine("no request found: expected 'prompt' and 'output' token ids, 'prompt' and 'completion' "
                        "text, or chat 'messages'")


def _messages(obj: dict) -> list[dict] | None:
    """The conversation of a chat line with every content as text, or None when the line has none."""
    found = obj.get("messages")
    request = obj.get("request")
    if found is None and isinstance(request, dict):
        found = request.get("messages")
        if found is None and isinstance(request.get("body"), dict):
            found = request["body"].get("messages")
    if found is None:
        return None
    if not isinstance(found, list):
        raise MalformedLine("'messages' must be a list of {role, content} objects")
    out = []
    for i, m in enumerate(found):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise MalformedLine(f"message {i} is not a {{role, content}} object")
        out.append({**m, "content": _content_text(m.get("content"), f"message {i}")})
    return out


def _content_text(content: object, what: str) -> str:
    """Message content as text: a string, None (""), or OpenAI content parts (their text parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type", "text") == "text"]
        texts = [p for p in parts if isinstance(p, str)]
        if len(texts) == len(parts):
            return "".join(texts)
    raise MalformedLine(f"{what}: content must be text or a list of text parts")


def _answer(obj: dict) -> str | None:
    """The answer of a chat line: a text field, or the first choice of an OpenAI response object."""
    for key in _ANSWER_KEYS:
        value = obj.get(key)
        if isinstance(value, str):
            return value
        if isinstance(value, dict):
            body = value.get("body")
            found = _choice_text(body if isinstance(body, dict) else value)
            if found is not None:
                return found
    return _choice_text(obj)


def _choice_text(obj: dict) -> str | None:
    choices = obj.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    first = choices[0]
    if isinstance(first.get("message"), dict):
        return _content_text(first["message"].get("content"), "choices[0].message")
    return first["text"] if isinstance(first.get("text"), str) else None
