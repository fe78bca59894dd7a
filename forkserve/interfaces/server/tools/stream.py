"""ToolCallStream: a streamed reply that may turn into tool calls.

Text before the calls streams as ``content`` as it comes; from the format's start marker
on, the text is held (a half-written call is no use to a client) and parsed when the
generation ends, so each call goes out whole in one ``tool_calls`` delta. A tail that could
still be the start of a marker is held back, so no streamed content is ever taken back.
"""

from __future__ import annotations

from forkserve.interfaces.server.tools.formats import ParsedReply, ToolFormat


class ToolCallStream:
    def __init__(self, fmt: ToolFormat) -> None:
        self._fmt = fmt
        self._text = ""
        self._sent = 0  # characters already streamed as content
        self._calling = False

    def push(self, delta: str) -> str:
        """The content that is safe to stream after ``delta``."""
        self._text += delta
        if self._calling:
            return ""
        at = self._fmt.find_start(self._text)
        if at >= 0:
            self._calling = True
            end = at
        else:
            end = len(self._text) - self._fmt.hold(self._text)
        return self._take(end)

    def finish(self) -> tuple[str, ParsedReply]:
        """(content not streamed yet, the whole reply parsed)."""
        reply = self._fmt.parse(self._text)
        if reply.calls:
            return "", reply
        return self._take(len(self._text)), reply

    def _take(self, end: int) -> str:
        if end <= self._sent:
            return ""
        out = self._text[self._sent : end]
        self._sent = end
        return out
