"""Train a draft for a Hugging Face target (the SmolLM2-135M-Instruct conversion by default).

    python -m avspec.tools.train.draft --target models/target --work build/draft-smollm2

One module per job: `prompts` (chat prompts from the project's own corpora, no downloads),
`self_prompts` (user messages the target writes itself from its template's pre-query, Magpie:
general chat, `--self-prompts N`), `generate` (the target answers them; its top-64 logits are
saved for distillation, in chunks, resumable), `model` (the draft's shape and its embedding taken
from the target), `train` (top-64 KL distillation, checkpointed, resumable), `evaluate`
(held-out acceptance at position 1 and the AUC of logit(q_max)), `model_card` (the pair's card,
`make card`: figures from `card_measure` and `card_cost`, text by `card_render`) and `__main__`
(the pipeline, `make draft`).
"""
