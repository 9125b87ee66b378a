"""``python -m bench.served_gap``: does what the learner learns reach the served draft? The float
training copy against the served int4 draft (the fast path's packed copy, each published version
loaded into it), as teacher-forced top-1 agreement with the target's greedy tokens on held-out
records, for a whole-draft learner and for adapter learners (docs/proposers.md, "Adapters").

40 SQL prompts of bench/data/train.jsonl are served greedily (32 tokens, k = 4, chat template) by the default
engine (int4 target, the untrained two-layer draft); 30 become the replay records the learners
train on (20 rounds of 2 steps on 16 records drawn with a fixed seed), 10 are held out.
"""

from __future__ import annotations

import copy
import time

import torch

from config import EngineConfig, KPolicyConfig, SamplingParams
from drafts.build import build_engine
from learner.replay import RecordBuilder
from learner.trainer import DraftTrainer, LearnerConfig
from speculative.fast import FastRunner
from workloads import load_workload

#: (adapter rank, 0 = the whole draft; learning rate; bits of the served draft's head)
VARIANTS = [(0, 3e-4, 4), (0, 3e-4, 8), (16, 1e-3, 4), (16, 3e-3, 4)]


def _agreement(predict, held, vocab_map) -> float:
    """Share of held-out output tokens the draft predicts, teacher-forced. ``predict(i, ids)`` gives
    the argmax at every position of ``ids``."""
    hit = n = 0
    for i, (prompt, out) in enumerate(held):
        pred = predict(i, prompt + out)
        pred = pred if vocab_map is None else vocab_map[pred]
        hit += int((pred[len(prompt) - 1 : len(prompt) + len(out) - 1] == torch.tensor(out)).sum())
        n += len(out)
    return hit / n


def main() -> int:
    torch.set_num_threads(2)
    engine = build_engine(EngineConfig(k=KPolicyConfig(fixed_k=4, k_max=4)), calibrate=False)
    recs = [r for r in load_workload("bench/data/train.jsonl") if r.domain == "sql"][:40]
    served_records = []
    t0 = time.time()
    for r in recs:
        prompt = engine.encode(r.text)  # with the chat template, as a server's request
        b = RecordBuilder(probs_dtype=torch.float32)
        g = engine.generate(list(prompt), SamplingParams(max_tokens=32), on_step=b.add)
        served_records.append((list(prompt), g.token_ids, b.finish(list(prompt) + g.token_ids, len(prompt), draft_id="d")))
    print(f"served {len(recs)} records in {time.time() - t0:.0f} s", flush=True)
    train = [x[2] for x in served_records[:30]]
    held = [(p, out) for p, out, _ in served_records[30:]]
    draft = engine.learned_draft
    vm = draft.runner.vocab_map

    def float_pred(model):
        def run(i, ids):
            with torch.no_grad():
                return model(input_ids=torch.tensor([ids])).logits[0].argmax(-1)
        return run

    def served_pred(runner):
        def run(i, ids):
            runner.release(f"h{i}")
            return runner.forward(f"h{i}", 0, ids, len(ids)).argmax(-1)
        return run

    for rank, lr, head_bits in VARIANTS:
        cfg = LearnerConfig(train_every=4, batch_records=16, steps_per_round=2, lr=lr, positions="all",
                            holdout_fraction=0.0, gate_margin=1.0, adapter_rank=rank)
        trainer = DraftTrainer("d", draft.runner.model, cfg, keep_ids=vm)
        served = FastRunner(copy.deepcopy(draft.runner.model), vm, "d", bits=4, head_bits=head_bits)
        tag = f"{'whole draft' if rank == 0 else f'adapters, rank {rank}'}, lr {lr:g}, served head {head_bits}-bit"
        print(f"{tag}: start float {_agreement(float_pred(trainer.model), held, vm):.3f} "
              f"served {_agreement(served_pred(served), held, vm):.3f}", flush=True)
        gen = torch.Generator().manual_seed(0)
        for rnd in range(20):
            trainer.train_round([train[int(j)] for j in torch.randint(0, len(train), (16,), generator=gen)])
            _, state = trainer.publish()
            served.load_state_dict(state)
            if rnd % 10 == 9:
                print(f"{tag}: round {rnd + 1} float {_agreement(float_pred(trainer.model), held, vm):.3f} "
                      f"served {_agreement(served_pred(served), held, vm):.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
