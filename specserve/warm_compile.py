"""The child process of ``--torch-compile-in-background`` on a cold cache (``models/compile_warm.py``, which starts
it): a background-compiling engine with the server's settings runs the warm-up requests, filling torch.compile's
on-disk cache with the graphs the server will build, then leaves the marker that tells later starts the cache is
warm.

    python -m specserve.warm_compile SETTINGS_JSON MARKER_PATH
"""

from __future__ import annotations

import json
import os
import sys

from specserve.bench.harness import build_background_graphs
from specserve.engine import Engine

#: warm-up passes of the child: it stops after the first that builds no new graph, or after the third (SmolLM2 with
#: its EAGLE-3 head, three runs: 14, 2-3 and 0-1 new graphs); what a later pass would have built, the server builds
MAX_PASSES = 3


def warm(settings: dict, marker: str) -> int:
    """The child's work: a background-compiling engine runs the warm-up requests at each thread count the server may
    run with (highest first), until a pass builds no new graph (at most MAX_PASSES per count), then the marker.
    -> graphs built."""
    with Engine(**settings) as engine:
        compiler = engine.scheduler.runner.background_compiler
        compiler.build_at_target = True  # graphs for the count being warmed, while forwards yield a core to builds
        counts = []
        for threads in sorted(compiler.counts, reverse=True):
            engine.loop.call(lambda s, n=threads: s.runner.platform.fix_threads(n))
            counts += build_background_graphs(engine, lambda: engine.loop.call(lambda s: s.warm_up()), MAX_PASSES)
            print(f"graphs after each pass at {threads} threads:", counts, flush=True)
    with open(marker + ".tmp", "w") as f:
        f.write(f"{counts[-1]} graphs\n")
    os.replace(marker + ".tmp", marker)  # whole or absent
    return counts[-1]


def main(argv: list[str] | None = None) -> int:
    settings_json, marker = (argv or sys.argv[1:])[:2]
    warm(json.loads(settings_json), marker)
    return 0


if __name__ == "__main__":
    sys.exit(main())
