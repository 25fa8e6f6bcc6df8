import json, sys, time, torch
from pathlib import Path
from avspec.av.cost_file import load_step_cost
from avspec.engine.scheduler import Scheduler
from avspec.engine.sequence import GenerationRequest
from avspec.engine.step import SpeculativeStep
from avspec.runtime.model_dir import load_tokenizer
torch.set_num_threads(1)
ROOT = Path("/work/main")
prompts = [json.loads(l)["prompt"] for l in (ROOT / "workloads/chat.jsonl").read_text().splitlines()[:int(sys.argv[1])]]
step = SpeculativeStep.from_model_dirs(ROOT / "models/target", ROOT / "models/draft", 8, 4, 1024, "cpu",
                                       cost=load_step_cost(ROOT / "models/cost_tables.json"), dtype=torch.bfloat16)
tok = load_tokenizer(ROOT / "models/target")
arms = {"k2": dict(num_draft_tokens=2, adaptive=False), "ad2": dict(num_draft_tokens=2, adaptive=True, adaptive_drafting=True),
        "av2": dict(num_draft_tokens=2, adaptive=True, adaptive_drafting=False), "ad8": dict(num_draft_tokens=8, adaptive=True, adaptive_drafting=True)}
tot = {a: [0, 0, 0, 0, 0.0] for a in arms}
for rnd in range(2):
    for a, kw in arms.items():
        for i, p in enumerate(prompts):
            sched = Scheduler(step, tok.eos_ids, 1, 1024, 8)
            reps = []
            sched.submit(GenerationRequest(tok.encode(p), 40, temperature=0.7, top_p=0.95, random_seed=rnd * 100 + i, **kw), reps.append, print)
            t = time.perf_counter(); sched.run_until_idle(); el = time.perf_counter() - t
            tot[a][0] += sum(r.drafted for r in reps); tot[a][1] += sum(r.verified for r in reps)
            tot[a][2] += sum(r.accepted for r in reps); tot[a][3] += sum(len(r.new_tokens) for r in reps); tot[a][4] += el
    print(rnd, {a: dict(drafted=v[0], verified=v[1], accepted=v[2], acc_per_verified=round(v[2] / max(v[1], 1), 3), tokens=v[3], tok_s=round(v[3] / v[4], 1)) for a, v in tot.items()}, flush=True)
