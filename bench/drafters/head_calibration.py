"""The head's logit(q_max) as the online estimator sees it: p = sigmoid(w f + b_k), one slope and an
intercept per depth, fitted on half of the held-out positions (labels drawn from each position's
acceptance, seed 0) and scored on the other half (fitted ECE, 10 bins; AUC).

    .venv/bin/python bench/drafters/head_calibration.py > bench/drafters/head_calibration.txt
"""

from __future__ import annotations

import numpy as np
import torch

from avspec.av.calibration import auc, ece
from avspec.engine.draft_vocab import load_draft_vocab
from avspec.runtime.head import load_head
from avspec.runtime.model_dir import load_model
from avspec.tools.train.draft.evaluate import load_chunks, logit
from avspec.tools.train.features_zoo import fit_logistic, predict_logistic
from avspec.tools.train.head.evaluate import head_outcomes

SETS = ("heldout", "heldout_general")


def main() -> None:
    torch.set_num_threads(2)
    target = load_model("models/target", max_length=1024)
    head, _ = load_head("models/head", target)
    kept = torch.tensor(load_draft_vocab("models/head/draft_vocab.json", 49152).token_ids)
    rng = np.random.default_rng(0)
    print(f"{'set':<16} {'labels':>7} {'slope':>6} {'intercepts':>22} {'ECE':>6} {'AUC':>6}")
    for name in SETS:
        outcomes = head_outcomes(head, load_chunks(f"build/drafter-data/{name}"), kept, depth=3)
        depth = len(outcomes)
        rows = sum(len(a) for a, _ in outcomes)
        features, labels = np.zeros((rows, depth)), np.zeros((rows, depth))
        mask = np.zeros((rows, depth), dtype=bool)
        start = 0
        for d, (accept, q_max) in enumerate(outcomes):  # each position a row of its own depth
            n = len(accept)
            features[start : start + n, d] = logit(q_max).double().numpy()
            labels[start : start + n, d] = rng.random(n) < accept.double().numpy()
            mask[start : start + n, d] = True
            start += n
        fit = rng.random(rows) < 0.5
        slope, intercepts = fit_logistic(features, labels, mask & fit[:, None])
        held = mask & ~fit[:, None]
        predicted = predict_logistic(features, slope, intercepts)[held]
        b = "/".join(f"{x:.2f}" for x in intercepts)
        print(f"{name:<16} {int(held.sum()):>7} {slope:>6.3f} {b:>22} "
              f"{ece(predicted, labels[held]):>6.3f} {auc(features[held], labels[held]):>6.3f}",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
