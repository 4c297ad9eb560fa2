"""benchmarks/bench_prefill_rows.py end to end on the demo family: padded and own-row-count prefills alternate over
prompts of lengths sent once each, and the padding threshold is restored afterwards."""

from bench_prefill_rows import main
from specserve.platform.cpu import packing


def test_bench_prefill_rows_alternates_and_restores_the_padding(capsys):
    before = packing.PAD_FROM
    main(["--model-path", "demo", "--draft-model-path", "demo-eagle3", "--trials", "2", "--prompt-words", "20",
          "--num-threads", "1"])
    header, line = capsys.readouterr().out.strip().splitlines()[-2:]
    assert header.startswith("demo + demo-eagle3, bf16, 1 threads, 2 trials, prompts of ")
    first, last = header.split("prompts of ")[1].split(" tokens")[0].split("-")
    assert int(last) - int(first) >= 3  # four prompts, each of its own length
    padded = float(line.split("padded ")[1].split(" ms")[0])
    own = float(line.split("own row count ")[1].split(" ms")[0])
    assert padded > 0 and own > 0
    assert abs(float(line.split("own / padded ")[1]) - own / padded) < 5e-3  # the two medians' ratio
    assert packing.PAD_FROM == before
