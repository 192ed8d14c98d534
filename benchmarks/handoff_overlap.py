"""`python -m benchmarks.handoff_overlap`: how much of a handoff the prefill hides.

A prefill engine and a decode engine in this process (the default model, one thread each)
hand over six 1,024-token prompts by each transport. The prefill side reports the seconds
from the forward pass's start to the handoff delivered, and the part of them after the
first token: the send the forward pass did not hide. The torch transport streams each layer
as it is computed; the shared-memory one writes the whole file after the first token.
"""

from kvserve import LLM, SamplingParams
import statistics
def run(e, reqs):
    for rid, p, params, t in reqs: e.add_request(rid, p, params, kv_transfer=t)
    out = {}
    while e.has_unfinished_requests():
        for o in e.step():
            if o.finished: out[o.request_id] = o
    return out
if __name__ == "__main__":
    for transport in ("torch", "shm"):
        d = LLM(None, kv_role="decode", kv_transport=transport, kv_cache_memory="256MiB", num_threads=1).engine
        p = LLM(None, kv_role="prefill", kv_transport=transport, kv_cache_memory="256MiB", num_threads=1).engine
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        tot, after = [], []
        for i in range(6):
            prompt = [100 + (7 * i + j) % 20000 for j in range(1024)]
            r = run(p, [(f"p{i}", prompt, params, {"do_remote_decode": True, "transfer_id": f"ov{transport}{i}", "remote_address": d.connector.transport.address})])
            k = r[f"p{i}"].kv_transfer_params
            tot.append(k["seconds"]); after.append(k["seconds_after_first_token"])
            run(d, [(f"d{i}", prompt, params, {"do_remote_prefill": True, "transfer_id": f"ov{transport}{i}"})])
        print(f"{transport}: {k['bytes']:,} bytes per handoff; prefill and send {statistics.median(tot) * 1e3:.1f} ms, "
              f"of which after the first token {statistics.median(after) * 1e3:.1f} ms (medians of 6)")
