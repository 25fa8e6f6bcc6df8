"""Training: the drafts (`draft/`, the default pair's; `tiny/`, the tiny pair), the pieces they
share
(the shared embedding, the reduced draft vocabulary, corpus prefixes) and the offline comparison
of acceptance features.
"""
