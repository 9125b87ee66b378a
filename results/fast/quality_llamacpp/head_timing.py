"""The head's cost, run once in each tree (the previous kernel's and this one's) as
`python head_timing.py NAME`: the target's head (49,152 x 576, 8 bits) on M rows, median of 60
calls, then a decode step (1 token) and a verify step (5 tokens) at position 128, median of 40
(each call rewrites the positions from 128 on). Output: head_timing.txt."""
import time, statistics, torch, json, sys
from config import ModelConfig
from speculative.fast import FastRunner
from speculative.models import load_model
torch.set_num_threads(2)
target, tok = load_model(ModelConfig(quantize="none"))
r = FastRunner(target, bits=4)
out = {}
for M in (1, 5, 8, 32):
    x = torch.randn(M, 576)
    for _ in range(5): r.head(x)
    ts = []
    for _ in range(60):
        t0 = time.perf_counter(); r.head(x); ts.append(time.perf_counter() - t0)
    out[f"head M={M} ms"] = round(statistics.median(ts) * 1e3, 3)
ctx = list(range(1000, 1128))
def step(n):
    r.forward("s", 0, ctx, 1)
    ts = []
    for i in range(40):
        t0 = time.perf_counter(); r.forward("s", 128, list(range(2000, 2000 + n)), n); ts.append(time.perf_counter() - t0)
    r.release("s")
    return round(statistics.median(ts) * 1e3, 3)
out["step 1 token ms"] = step(1); out["step 5 tokens ms"] = step(5)
print(sys.argv[1], json.dumps(out))
