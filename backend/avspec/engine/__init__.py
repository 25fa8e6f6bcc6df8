"""The step engine: sequence slots, draft and target stages, the in-process step, the scheduler."""
