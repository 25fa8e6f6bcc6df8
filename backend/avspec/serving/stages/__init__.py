"""What runs inside Triton's Python-backend stubs: the entry model, the stage adapters, the
verifier, their request handling and metrics. Imports the engine, the runtime, the contract and
`avspec.serving.repository`; never the host side or the front."""
