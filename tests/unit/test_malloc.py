"""specserve.platform.cpu.malloc: glibc malloc settings for a CPU serving process (measured effect in its docstring)."""

import subprocess
import sys
import textwrap

import pytest

from specserve.platform.cpu.malloc import KEEP_DEFAULTS_ENV, should_tune


@pytest.mark.parametrize("environ,want", [
    ({}, True),
    ({KEEP_DEFAULTS_ENV: "0"}, True),
    ({KEEP_DEFAULTS_ENV: "1"}, False),  # the opt-out for A/B runs
    ({"MALLOC_ARENA_MAX": "4"}, False),  # a user's own malloc settings are left as they are
    ({"MALLOC_MMAP_THRESHOLD_": "65536"}, False),
    ({"MALLOC_TRIM_THRESHOLD_": "0"}, False),
])
def test_should_tune_respects_the_environment(environ, want):
    assert should_tune(environ) is want


SCRIPT = textwrap.dedent("""
    import os, sys
    from specserve.platform.cpu import malloc
    print(malloc.tune_malloc(), malloc.tune_malloc(), malloc._mallopt() is not None)
""")


def _run(env_extra: dict) -> list[str]:
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_",
                                                            "MALLOC_TRIM_THRESHOLD_", KEEP_DEFAULTS_ENV)}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True,
                         env={**env, **env_extra})
    return out.stdout.split()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_tune_malloc_applies_once_and_honours_the_opt_out():
    tuned, again, has_mallopt = _run({})
    assert has_mallopt == "True", "a Linux CI machine runs glibc"
    assert tuned == "True" and again == "True"  # every setting accepted; a second call is the cached result
    assert _run({KEEP_DEFAULTS_ENV: "1"})[:2] == ["False", "False"]


def test_a_cpu_engine_tunes_malloc_before_loading(llama_dir, monkeypatch):
    import specserve.engine as engine_mod
    from specserve.platform import CpuPolicy

    calls = []
    real_runner = engine_mod.ModelRunner
    monkeypatch.setattr(CpuPolicy, "tune_allocator", lambda self: calls.append("tune"))
    monkeypatch.setattr(engine_mod, "ModelRunner", lambda *a: calls.append("load") or real_runner(*a))
    with engine_mod.Engine(model_path=llama_dir, device="cpu", max_total_tokens=512) as e:
        assert isinstance(e.scheduler.runner.platform, CpuPolicy)
    assert calls == ["tune", "load"]
