"""Helpers for server tests: SSE parsing, polling, metric reading."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import requests

GREEDY = {"temperature": 0, "ignore_eos": True}


def sse_payloads(resp: requests.Response) -> list[str]:
    """The `data:` payloads of an SSE response, in order (the raw strings, '[DONE]' included)."""
    out = []
    for line in resp.iter_lines(decode_unicode=True):
        if line.startswith("data: "):
            out.append(line[len("data: "):])
        else:
            assert line == "", f"unexpected SSE line {line!r}"
    return out


def sse_json(resp: requests.Response) -> list[dict]:
    """Checks the stream ends with exactly one [DONE] and returns the JSON events before it."""
    payloads = sse_payloads(resp)
    assert payloads and payloads[-1] == "[DONE]", payloads[-3:]
    assert payloads.count("[DONE]") == 1
    return [json.loads(p) for p in payloads[:-1]]


def poll(cond: Callable[[], bool], timeout: float = 120.0, interval: float = 0.1, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def metric(text: str, name: str, labels: str = "") -> float:
    """The value of one sample of a Prometheus text exposition (0.0 when absent)."""
    key = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    return 0.0
