"""/tokenize side by side: this server (make run, 127.0.0.1:8000) and llama-server on the same GGUF
(tools/llama_server.sh run 8090). For each text: the ids, the ids with pieces (with_pieces) and the
ids with special tokens' text read as text (parse_special false); how many are equal, and where the
others first differ. Run from the repository root."""
import json
import urllib.request


def post(url, body):
    req = urllib.request.Request(url + "/tokenize", json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req).read())["tokens"]


records = [json.loads(line) for line in open("bench/data/open.jsonl")]
texts = ["🦙 ok héllo 万里长城 <|im_start|>x<|im_end|>"] + [r["text"][:400] for r in records[:40]]
same = {"ids": 0, "pieces": 0, "plain": 0}
for t in texts:
    for opts, key in (({"with_pieces": True}, "pieces"), ({"parse_special": False}, "plain"), ({}, "ids")):
        same[key] += post("http://127.0.0.1:8000", {"content": t, **opts}) == post("http://127.0.0.1:8090", {"content": t, **opts})
print(len(texts), same)
for t in texts:  # where they differ: a few pieces from the first difference, ours then llama-server's
    a, b = (post(u, {"content": t, "with_pieces": True}) for u in ("http://127.0.0.1:8000", "http://127.0.0.1:8090"))
    if a != b:
        i = next(i for i in range(min(len(a), len(b))) if a[i] != b[i])
        print(repr("".join(str(p["piece"]) for p in a[max(0, i - 2):i + 3])), [p["piece"] for p in a[i:i + 3]],
              [p["piece"] for p in b[i:i + 3]])
