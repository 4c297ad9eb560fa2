"""Coupled drafting's rows on hand-checked inputs: which rows race, their output positions, their filters, and the
noise shared with verification."""

from types import SimpleNamespace

import torch

from specserve.sampling.params import SamplingParams
from specserve.sampling.race import exponentials, race_keys
from specserve.speculative.coupling import RaceBatch


def req(temperature: float, seed: int | None, outputs: int, **params):
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return SimpleNamespace(params=SamplingParams(temperature=temperature, **params), generator=gen,
                           output_ids=[0] * outputs)


def test_only_sampled_requests_race():
    assert RaceBatch.of([req(0.0, None, 3)], levels=2) is None
    batch = RaceBatch.of([req(0.0, None, 3), req(0.5, 7, 4, top_k=2), req(1.0, 9, 0, top_p=0.5)], levels=2)
    assert batch.rows == [1, 2] and batch.seeds == [7, 9] and batch.positions == [4, 0]
    assert batch.inv_temps == [2.0, 1.0]


def test_scores_carry_verifications_noise_and_the_requests_filters():
    reqs = [req(0.0, None, 3), req(1.0, 7, 4, top_k=2), req(1.0, 9, 0)]
    batch = RaceBatch.of(reqs, levels=3)
    ids = torch.tensor([10, 11, 12, 13])  # the draft's columns are these target ids
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]] * 6))  # 2 rows per request, request-major
    rows = batch.at_level(2, 2, ids)
    assert rows.index.tolist() == [2, 3, 4, 5]
    out = rows.scores(logits)
    assert torch.equal(out[:2], logits[:2])  # the greedy request's rows are untouched
    # level 2 = output positions 4 + 2 and 0 + 2: the noise verification uses there, for the target ids
    expo = exponentials(race_keys([7, 9], [6, 2], "cpu"), ids)  # [2, 4]
    q_top2 = torch.tensor([0.0, 0.0, 3 / 7, 4 / 7])  # top_k 2 of q, renormalised
    torch.testing.assert_close(out[2], torch.log(q_top2) - torch.log(expo[0]))
    torch.testing.assert_close(out[3], out[2])
    torch.testing.assert_close(out[4], torch.log(torch.tensor([0.1, 0.2, 0.3, 0.4])) - torch.log(expo[1]))
    assert torch.isinf(out[2, :2]).all()  # a token the request's top_k cuts is never drafted for it


def test_scores_when_every_row_races():
    """A batch of sampled requests only (the rows need no gather or scatter) and no filter: each row is its
    tempered log-softmax minus the log of verification's noise at its level, up to a constant per row (the
    log-softmax's normaliser, which the softmax that ranks the candidates ignores)."""
    reqs = [req(0.5, 7, 4), req(1.0, 9, 1)]
    batch = RaceBatch.of(reqs, levels=2)
    ids = torch.tensor([3, 1, 2])
    logits = torch.tensor([[0.5, -1.0, 2.0], [0.0, 0.0, 1.0], [1.0, 2.0, 3.0], [-2.0, 0.0, 0.5]])  # 2 rows each
    rows = batch.at_level(1, 2, ids)
    assert rows.index.tolist() == [0, 1, 2, 3] and not any(rows.on)
    out = rows.scores(logits)
    expo = exponentials(race_keys([7, 9], [5, 2], "cpu"), ids)  # positions 4 + 1 and 1 + 1
    inv_t = torch.tensor([[2.0], [2.0], [1.0], [1.0]])
    want = torch.log(torch.softmax(logits * inv_t, -1)) - torch.log(expo.repeat_interleave(2, dim=0))
    shift = out - want  # [4, 3]: one value per row
    torch.testing.assert_close(shift, shift[:, :1].expand_as(shift))
    torch.testing.assert_close(torch.softmax(out, -1), torch.softmax(want, -1))
    assert not torch.equal(out[0], out[1])  # a request's rows keep their own logits under the shared noise
