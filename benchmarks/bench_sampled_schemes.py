"""Lossless verification schemes for sampled requests, compared on a real draft and target: first-level acceptance.

A sampled request is decoded plainly while, at every step, the target's processed distribution p and the draft's
distribution q at the root are recorded (the draft's at the request's temperature, top-k and top-p). For each pair
and each number of drafted children K, the chance that the first drafted level is accepted is computed for:

- ``target-only``: the K most probable draft tokens, accepted when the target's own sample is one of them
  (SGLang's tree sampling rule, and specserve's before coupled drafting): sum of p over the draft's top K (exact);
- ``coupled``: the K best tokens of the draft's exponential race with the noise the target's race will use
  (specserve's coupled drafting): accepted when the target's race winner is among them (Monte Carlo over noise);
- ``specinfer``: K drafts sampled independently from q, verified by recursive rejection sampling (SpecInfer):
  draft i is accepted with probability min(1, r_i(x) / q(x)), r_1 = p, r_(i+1) = norm(max(r_i - q, 0))
  (Monte Carlo). It accepts the most per single draft (1 - TV(p, q) at K = 1), but a request's tokens then
  depend on the drafts, so seeds do not reproduce across speculation on/off or batch mates.

    python benchmarks/bench_sampled_schemes.py --temperature 0.7 --num-prompts 8
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch import Tensor

from specserve import Engine
from specserve.bench.eval_acceptance import held_out_prompts_for
from specserve.sampling.sampler import filter_top_k_top_p_min_p
from specserve.scheduler import spec_decode
from specserve.speculative import eagle


def target_only(p: Tensor, q: Tensor, k: int) -> float:
    """p, q [V] -> P(the target's sample is one of the draft's k most probable tokens)."""
    return float(p[q.topk(k).indices].sum())


def coupled(p: Tensor, q: Tensor, k: int, expo: Tensor) -> float:
    """expo [M, V] Exp(1) draws -> the fraction of draws whose target race winner argmax p / E is among the k best
    of the draft's race q / E."""
    winner = (p / expo).argmax(dim=-1, keepdim=True)  # [M, 1]
    drafted = (q / expo).topk(k, dim=-1).indices  # [M, k]
    return float((drafted == winner).any(dim=-1).float().mean())


def specinfer(p: Tensor, q: Tensor, k: int, draws: int, gen: torch.Generator) -> float:
    """Recursive rejection sampling over k independent drafts from q: the fraction of `draws` runs that accept one
    of them."""
    accepted = 0
    for _ in range(draws):
        r = p.clone()
        for x in torch.multinomial(q, k, replacement=True, generator=gen).tolist():
            if torch.rand((), generator=gen) < min(1.0, float(r[x] / q[x])):
                accepted += 1
                break
            r = (r - q).clamp(min=0.0)
            if float(r.sum()) <= 0.0:
                break
            r = r / r.sum()
    return accepted / draws


def capture(ns: argparse.Namespace) -> list[tuple[Tensor, Tensor]]:
    """(p, q) at the root of every speculative step of sampled requests decoded with the draft."""
    pairs: list[tuple[Tensor, Tensor]] = []
    pending: list[Tensor] = []
    real_propose, real_race = eagle.EagleProposer.propose, spec_decode.race_node_ids

    def propose(self, reqs, shape=None):
        with torch.inference_mode():
            logits, to_target = self._draft_logits(torch.stack([r.spec_state.hidden for r in reqs]))
        p = reqs[0].params
        q = torch.softmax(logits[:1].float() / p.temperature, dim=-1)  # [1, Vd]
        top_k = torch.tensor([p.top_k if p.top_k > 0 else q.shape[-1]])
        q = filter_top_k_top_p_min_p(q, top_k.clamp(max=q.shape[-1]), torch.tensor([p.top_p]), torch.tensor([p.min_p]))
        full = torch.zeros(self.runner.spec.vocab_size)
        full[to_target if to_target is not None else torch.arange(q.shape[-1])] = q[0]
        pending.append(full)
        return real_propose(self, reqs, shape)

    def race(depth, probs, keys):
        pairs.append((probs[0, 0].float().clone(), pending.pop()))
        return real_race(depth, probs, keys)

    eagle.EagleProposer.propose, spec_decode.race_node_ids = propose, race
    try:
        kw = dict(model_path=ns.model_path, dtype=ns.dtype, speculative_algorithm=ns.algorithm,
                  speculative_draft_model_path=ns.draft, speculative_num_steps=1, speculative_eagle_topk=1,
                  speculative_num_draft_tokens=2, disable_speculative_auto_off=True, speculative_batch_token_budget=0)
        with Engine(**kw) as e:
            for i, prompt in enumerate(held_out_prompts_for(ns.model_path, ns.num_prompts)):
                e.generate(prompt, {"temperature": ns.temperature, "top_p": ns.top_p, "top_k": ns.top_k,
                                    "max_new_tokens": ns.max_new_tokens, "ignore_eos": True, "seed": i})
    finally:
        eagle.EagleProposer.propose, spec_decode.race_node_ids = real_propose, real_race
    return pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", default="demo")
    ap.add_argument("--algorithm", default="EAGLE3")
    ap.add_argument("--draft", default="demo-eagle3")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=-1)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--ks", default="1,2,4,8")
    ap.add_argument("--draws", type=int, default=200, help="Monte Carlo draws per recorded step")
    ns = ap.parse_args()
    pairs = capture(ns)
    gen = torch.Generator().manual_seed(0)
    tv = statistics.fmean(0.5 * float((p - q).abs().sum()) for p, q in pairs)
    print(f"{ns.model_path} + {ns.draft}, temperature {ns.temperature}, top_p {ns.top_p}, top_k {ns.top_k}: "
          f"{len(pairs)} steps; mean TV(p, q) {tv:.3f}")
    print("| drafted children K | target-only | coupled | specinfer |")
    print("|---:|---:|---:|---:|")
    for k in (int(v) for v in ns.ks.split(",")):
        rows = []
        for p, q in pairs:
            expo = -torch.log1p(-torch.rand(ns.draws, p.numel(), generator=gen))  # [M, V] Exp(1)
            rows.append((target_only(p, q, k), coupled(p, q, k, expo), specinfer(p, q, k, ns.draws, gen)))
        means = [statistics.fmean(col) for col in zip(*rows, strict=True)]
        print(f"| {k} | " + " | ".join(f"{m:.3f}" for m in means) + " |")


if __name__ == "__main__":
    main()
