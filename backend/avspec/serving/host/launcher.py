"""Command line: serve model repositories with tritonserver behind the front until a signal.

`python -m avspec.serving.host.launcher --model-repository model_repository` serves the CPU
deployment with the tritonserver bundled in nvidia-pytriton (`make serve`). The GPU container
(docker/serve_gpu.sh) runs the same command with its installed tritonserver, backend directory,
two repositories, `--model-config-name gpu` and the models to load, so both deployments get the
same exposure (avspec.serving.host.server_process, avspec.serving.exposure).

The launcher's parts, in the order they run: the command line (avspec.serving.host.cli), the
settings made of it once (avspec.serving.host.settings: the keys read, avspec.serving.host.keys;
a `.gguf` --draft-model / --target-model converted into a Hugging Face directory under
--gguf-cache, avspec.serving.host.gguf_models, before root is dropped), the sandboxed
re-execution when started as root (avspec.serving.host.reexec), the repository served
(avspec.serving.host.served_repository: a user's pair checked and a rewritten copy), and the
serve loop (avspec.serving.host.serve: the ready line, restarts, the stop on a signal).
"""

from __future__ import annotations

import os
import signal
import sys

from avspec.serving.host.cli import parse_args
from avspec.serving.host.serve import StopRequested, request_stop, serve
from avspec.serving.host.settings import ServeSettings


def main(argv: list[str] | None = None) -> int:
    """Run the server until SIGINT/SIGTERM or until it dies; return the exit status.

    The first SIGINT/SIGTERM stops the server gracefully (status 0); one more during the stop
    is noted, the next kills the server's process group at once (`ServerProcess.stop`).
    Run as the process's command (`argv` None) by root, the launcher executes itself again in
    the sandbox (avspec.serving.host.reexec); called with `argv` from Python it keeps its
    process, and only tritonserver and its stubs are sandboxed (ServerProcess).
    """
    args = parse_args(argv)
    previous = {s: signal.signal(s, request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            settings = ServeSettings.from_args(args, os.environ)
        except (ValueError, OSError) as err:
            print(f"avspec: {err}", file=sys.stderr, flush=True)
            return 1
        return serve(settings, reexec=argv is None)
    except StopRequested as why:
        # raised inside one of serve's except clauses: the server is already stopped there
        print(f"avspec: stopped on {why}", flush=True)
        return 0
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


if __name__ == "__main__":
    sys.exit(main())
