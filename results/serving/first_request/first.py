import json, time, requests, sys, re
import pathlib; sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))
from workloads import load_workload
recs = load_workload(str(pathlib.Path(__file__).resolve().parents[3] / 'bench/data/mixture.jsonl'))[:8]
def metric(name):
    t = requests.get('http://127.0.0.1:8000/metrics').text
    m = re.search(rf'^{name} (\S+)', t, re.M); return float(m.group(1)) if m else 0.0
for r in recs:
    a = metric('osd_router_latency_seconds_sum')
    body = {"model": "smollm2-135m-instruct-osd", "messages": [{"role": "user", "content": r.text}], "max_tokens": 16, "temperature": 0, "stream": True}
    t0 = time.perf_counter(); first = None
    with requests.post('http://127.0.0.1:8000/v1/chat/completions', json=body, stream=True) as resp:
        for line in resp.iter_lines():
            if line and first is None and line.startswith(b'data: {'):
                j = json.loads(line[6:])
                if j['choices'] and j['choices'][0]['delta'].get('content'): first = time.perf_counter()
    t = time.perf_counter() - t0
    b = metric('osd_router_latency_seconds_sum')
    print(f"{r.domain:6s} ttft {1e3*(first-t0):6.0f} ms total {1e3*t:6.0f} ms, router {1e3*(b-a):5.0f} ms", flush=True)
