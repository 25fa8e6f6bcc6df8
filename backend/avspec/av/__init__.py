"""The adaptive-verification algorithm: feature, estimator and refit, survival, budget, verifier."""
