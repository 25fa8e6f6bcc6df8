import time, torch
from avspec.runtime.precision import load_served_model
torch.set_num_threads(1)
t = load_served_model("models/target", "cpu", "bfloat16", max_length=512)
d = load_served_model("models/draft", "cpu", "bfloat16", max_length=512)
tc, dc = t.new_cache(1, 512), d.new_cache(1, 512)
tc.allocate(0); dc.allocate(0)
ids = torch.randint(0, 40000, (150,))
with torch.inference_mode():
    t.forward_cached(tc, [0], ids, [150]); d.forward_cached(dc, [0], ids, [150])
junk = torch.empty(64 * 2**20 // 4)  # 64 MB: what the other stages and the IPC touch between steps
def target_step():
    with torch.inference_mode():
        s = time.perf_counter(); t.forward_cached(tc, [0], torch.tensor([5]), [1]); e = time.perf_counter()
    tc.rollback(0, 150); return (e - s) * 1e3
def other_work(kind):
    with torch.inference_mode():
        if kind in ("draft", "both"):
            for _ in range(3):
                d.forward_cached(dc, [0], torch.tensor([5]), [1])
            dc.rollback(0, 150)
        if kind in ("junk", "both"):
            junk.fill_(1.0)
import statistics
for rnd in range(2):
    for kind in ("none", "draft", "junk", "both"):
        times = []
        for _ in range(15):
            if kind != "none": other_work(kind)
            times.append(target_step())
        print(rnd, kind, "median %.1f min %.1f" % (statistics.median(times), min(times)), flush=True)
