"""Training of the draft head, the drafter that reads the target (`avspec.runtime.head`).

- `batch`: the draft pipeline's chunks with the target's features as dense training batches;
- `unroll`: the head run as it drafts, several steps deep (training-time test);
- `train`: the resumable training loop (token KL plus feature regression, every depth);
- `evaluate`: held-out acceptance by depth from saved data (teacher-forced);
- `python -m avspec.tools.train.head`: data (the draft pipeline with `--features`), train, save.
"""
