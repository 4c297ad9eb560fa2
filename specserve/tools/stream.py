"""ToolCallStream: splits a choice's output text, as it arrives, into content and tool calls."""

from __future__ import annotations

from specserve.tools.formats import ParsedCall, ToolCallFormat


class ToolCallStream:
    """Feed it the output text piece by piece (the last piece with final=True); each feed returns the content that is
    certain to be text by now, and the calls completed by now. Text that may still turn into a call (the start of a
    marker, an unfinished call) is held until it is known. A non-streamed answer is one final feed."""

    def __init__(self, fmt: ToolCallFormat) -> None:
        self.fmt = fmt
        self.pending = ""  # text received, not given out yet
        self.in_region = False  # pending starts with a call region
        self.at_output_start = True  # no content given out yet, and no call: the output's start is pending
        self.after_call = False  # the last thing out was a call: whitespace next is the calls' separator, dropped

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ParsedCall]]:
        self.pending += text
        content: list[str] = []
        calls: list[ParsedCall] = []
        while True:
            if self.after_call:
                self._drop_separator(final)
                if self.after_call:  # only whitespace so far: what follows decides
                    break
            if not self.in_region:
                start = self.fmt.find_start(self.pending, self.at_output_start)
                if start is None:
                    keep = 0 if final else self.fmt.held(self.pending, self.at_output_start)
                    content.append(self._take(len(self.pending) - keep))
                    break
                content.append(self._take(start))
                self.in_region = True
            end = self.fmt.find_end(self.pending)
            if end is None:
                if not final:
                    break
                end = len(self.pending)
            region = self._take(end)
            self.in_region = False
            self.at_output_start = False
            parsed = self.fmt.parse_region(region)
            if parsed is None:
                content.append(region)
            else:
                calls += parsed
                self.after_call = True
            if final and not self.pending:
                break
        out = "".join(content)
        if out:
            self.at_output_start = False
        return out, calls

    def _drop_separator(self, final: bool) -> None:
        """Drops the whitespace after a call; after_call stays set while the pending text is all whitespace."""
        rest = self.pending.lstrip()
        if rest or final:
            self.pending, self.after_call = rest, False

    def _take(self, n: int) -> str:
        head, self.pending = self.pending[:n], self.pending[n:]
        return head
