"""Train the tiny draft/target pair (`models/tiny`) on the Python standard library and its pydoc
topics. It was the default pair before SmolLM2-135M-Instruct; it stays for fast comparisons.

Corpus: the running Python's top-level standard-library `.py` files (code) plus the topics of
`pydoc_data/topics.py` (English prose, one pseudo-file per topic). Files are split into train
and held-out by a hash of their name (about 10 % held out), then joined with EOS. Training is
reproducible from `--seed` and the step counts (not wall time) on a given Python version.

    python -m avspec.tools.train.tiny --out models/tiny --seed 0

writes `models/tiny/target`, `models/tiny/draft` (see `avspec.runtime.model_dir`) and
`models/tiny/training_log.json` with held-out bits/byte, the acceptance curve by draft position and
samples.

One module per job: `corpus` (files, split, encoding), `train` (settings, schedule, the loop),
`evaluate` (bits/byte, acceptance by position, samples, the report), `model_card` (the
markdown card) and `__main__` (the command line above).
"""
