"""The cost tables of the host that serves: measured at first start, cached, never shipped.

The verifier prices a step with tables of measured milliseconds (avspec.av.cost_file). They hold
for one CPU, one runtime, one precision, one thread count and one pair of model files: measured
anywhere else they mislead the budget (on llama.cpp's engine the target prices 9 verified tokens
at several times one; in bfloat16 torch at about one). So the repository's verifier says
`cost_tables: "host"`, and the launcher resolves it before tritonserver starts:

- the key (`CostSetup.key`): the CPU (machine, Python, a hash of its flags: the llama.cpp build's
  key), the stages' engine, precisions and threads, K, draft_top_k and each model's files
  (name, size, modification time) and the ladder below;
- the file: `<cache>/<key>.json`, cache `--cost-cache`, else $AVSPEC_COST_CACHE, else
  ~/.cache/avspec/costs (started as root: /var/cache/avspec/costs, given to the server's user;
  a cache that cannot be written: a temporary file, measured each start);
- found: used as it is; missing, or `--remeasure-costs` (`make costs`): measured first by
  `python -m avspec.tools.bench.profile_costs` on a short ladder (`LADDER`: 40 s on torch, 2 min on
  llama.cpp's engine for the default pair on 2 cores), written there, then used.

The served path's per-step hops are not in an in-process profile: the file starts from
`OVERHEAD_MS`, and the verifier's online refresh (avspec.av.cost_refresh) replaces it with the
median of the served steps' own overhead, like the tables' scale. A measurement that fails leaves
the verifier on linear defaults, said in the log with the command to retry.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from avspec.runtime.head import is_head_dir
from avspec.runtime.hf_files import GGUF_FILE
from avspec.runtime.llamacpp.binding import cpu_key
from avspec.serving.host.model_pair import (
    STAGES,
    VERIFIER,
    PreparedPair,
    prepare_pair,
    resolve_auto_engine,
    served_parameters,
    stage_parameters,
)
from avspec.serving.repository import HOST_COST_TABLES, resolve_path

CACHE_ENV = "AVSPEC_COST_CACHE"
ROOT_CACHE = Path("/var/cache/avspec/costs")
# The profile's ladder: rows of a draft pass, batches verifying 0..K drafts, medians of 5.
LADDER = (
    "--context", "128", "--draft-rows", "1,4,16,64", "--verify-batch-sizes", "1,16,64",
    "--repeats", "5", "--warmup", "1",
)  # fmt: skip
OVERHEAD_MS = 5.3  # first guess of the served path's hops (2 cores, bf16); refreshed online


@dataclass(frozen=True)
class CostSetup:
    """What the cost tables of a deployment depend on, as the launcher resolved it."""

    target_dir: Path
    draft_dir: Path
    engine: str  # torch or llamacpp, both stages (a draft head's is torch, whatever the target's)
    target_dtype: str  # the stages' dtype parameters (torch), e.g. "auto"
    draft_dtype: str
    precisions: str  # what they resolved to on this CPU, e.g. "bfloat16/bfloat16"
    threads: int  # per stage: OMP_NUM_THREADS (torch) or the engine's threads, 0 = every core
    max_draft_tokens: int
    draft_top_k: int
    gguf: str  # llamacpp: the target's GGUF file name (the draft's is model.gguf)
    flash_attention: bool  # llamacpp: ggml's flash attention
    head: bool = False  # the draft is a head (avspec.runtime.head): on torch beside any target
    head_threads: int = 1  # a head beside a llama.cpp target: its torch threads

    def files(self) -> list[Path]:
        """The files each stage loads, whose identity is part of the key."""
        if self.engine == "llamacpp":
            draft = (
                sorted(self.draft_dir.glob("*.safetensors"))
                if self.head
                else [self.draft_dir / GGUF_FILE]
            )
            return [self.target_dir / self.gguf, *draft]
        return sorted(
            [*self.target_dir.glob("*.safetensors"), *self.draft_dir.glob("*.safetensors")]
        )

    def key(self) -> str:
        """`<engine>-<threads>t-<hash of the CPU, the setup, the files and the ladder>`."""
        facts = {k: str(v) for k, v in asdict(self).items()}
        facts["cpu"] = cpu_key()
        facts["ladder"] = " ".join(LADDER)
        for file in self.files():
            stat = file.stat()
            facts[f"file {file.resolve()}"] = f"{stat.st_size} {stat.st_mtime_ns}"
        digest = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]
        return f"{self.engine}-{self.threads or os.cpu_count()}t-{digest}"

    def profile_command(self, output: Path) -> list[str]:
        """The `avspec.tools.bench.profile_costs` run that measures this setup into `output`."""
        command = [
            sys.executable, "-m", "avspec.tools.bench.profile_costs",
            "--target-dir", str(self.target_dir), "--draft-dir", str(self.draft_dir),
            "--engine", self.engine, "--max-draft-tokens", str(self.max_draft_tokens),
            "--draft-top-k", str(self.draft_top_k), "--overhead-ms", str(OVERHEAD_MS),
            *LADDER, "--output", str(output), "--plot", str(output.with_suffix(".png")),
        ]  # fmt: skip
        if self.engine == "llamacpp":
            plain = [] if self.flash_attention else ["--no-flash-attention"]
            gguf = ["--target-gguf", self.gguf]
            command += ["--engine-threads", str(self.threads), *gguf, *plain]
            if self.head:  # the head's own runtime
                command += ["--draft-dtype", self.draft_dtype, "--threads", str(self.head_threads)]
            return command
        command += ["--dtype", self.target_dtype, "--draft-dtype", self.draft_dtype]
        return [*command, "--threads", str(self.threads or os.cpu_count())]


@dataclass(frozen=True)
class CostOptions:
    """The launcher's say in it: threads of a torch stage, the cache, measure again."""

    cpu_threads: int | None = 1  # OMP_NUM_THREADS of the stages (None or 0: every core)
    cache: Path | None = None
    remeasure: bool = False


def cost_setup(
    repository: Path, pair: PreparedPair, overrides: dict[str, dict[str, object]],
    cpu_threads: int | None,
) -> CostSetup:  # fmt: skip
    """The setup of the pair as served: engines already resolved (no `auto` left)."""
    stages = {role: stage_parameters(repository, role, overrides) for role in STAGES}
    target, draft = stages["target"], stages["draft"]
    engine = target.engine
    head = is_head_dir(pair.draft.directory)
    if draft.engine != engine and not head:
        raise ValueError(
            f"cost tables: the draft runs {draft.engine!r} and the target {engine!r}; give "
            "--cost-tables FILE (measured with client/profile_costs.py) for a mixed pair"
        )
    threads = target.threads if engine == "llamacpp" else (cpu_threads or 0)
    return CostSetup(
        target_dir=pair.target.directory,
        draft_dir=pair.draft.directory,
        engine=engine,
        target_dtype=target.dtype,
        draft_dtype=draft.dtype,
        precisions="gguf" if engine == "llamacpp" else f"{pair.draft.dtype}/{pair.target.dtype}",
        threads=threads,
        max_draft_tokens=target.max_draft_tokens,
        draft_top_k=draft.draft_top_k,
        gguf=target.gguf,
        flash_attention=target.flash_attention,
        head=head,
        head_threads=cpu_threads or os.cpu_count() or 1,
    )


def cache_directory(given: Path | None) -> Path:
    """`given`, else $AVSPEC_COST_CACHE, else ~/.cache/avspec/costs, or for root (who hands it
    to the server's user: `--cost-cache` in the sandboxed launcher's arguments)
    /var/cache/avspec/costs."""
    if given is not None:
        return given
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    if os.geteuid() == 0:
        return ROOT_CACHE
    return Path.home() / ".cache" / "avspec" / "costs"


def resolve_host_costs(
    repository: Path, pair: PreparedPair, overrides: dict[str, dict[str, object]],
    options: CostOptions,
) -> list[str]:  # fmt: skip
    """Give the verifier this host's cost tables where it asks for `host`: the cached file for
    this setup, measured first when missing or when `options.remeasure`. Updates `overrides` in
    place; returns the lines to print. Raises ValueError for a pair it cannot key (mixed
    engines)."""
    if served_parameters(repository, VERIFIER, overrides).get("cost_tables") != HOST_COST_TABLES:
        return []
    setup = cost_setup(repository, pair, overrides, options.cpu_threads)
    directory = cache_directory(options.cache)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        writable = os.access(directory, os.W_OK)
    except OSError:
        writable = False
    lines = []
    if not writable:
        lines.append(f"avspec: cost cache {directory} cannot be written: measuring for this run")
        directory = Path(tempfile.mkdtemp(prefix="avspec-costs-"))
    path = directory / f"{setup.key()}.json"
    if path.is_file() and not options.remeasure:
        line, value = f"avspec: cost tables of this host: {path}", str(path)
    elif (status := _measure(setup, path)) == 0 and path.is_file():
        line, value = f"avspec: cost tables of this host measured: {path}", str(path)
    else:  # the verifier's linear defaults, warned
        line = (f"avspec: measuring the cost tables failed (exit {status}): the verifier uses "
                "linear defaults; retry with make costs")  # fmt: skip
        value = ""
    overrides.setdefault(VERIFIER, {})["cost_tables"] = value
    return [*lines, line]


def _measure(setup: CostSetup, path: Path) -> int:
    """Profile `setup` into `path` (its progress on stderr); the profile's exit status."""
    threads = setup.threads or os.cpu_count()
    what = f"{setup.engine}, {setup.precisions}, {threads} thread{'s' if threads != 1 else ''}"
    print(f"avspec: measuring this host's cost tables ({what}; 1-2 minutes) ...", flush=True)
    with tempfile.TemporaryDirectory(prefix="avspec-mpl-") as config:  # matplotlib's cache
        environment = {**os.environ, "MPLCONFIGDIR": config}
        command = setup.profile_command(path)
        done = subprocess.run(command, stdout=subprocess.DEVNULL, env=environment, check=False)
    return done.returncode


def resolve_for_repository(
    repository: Path | str, overrides: dict[str, dict[str, object]], cpu_threads: int | None = 1
) -> list[str]:
    """For a tool that serves a copy of `repository` with its own ServerProcess (a benchmark, a
    soak): resolve the verifier's `host` as the launcher does, for the pair the stages' model_dir
    name (`overrides`, else the repository's). Also fixes an `auto` engine in `overrides` (the
    choice the stages would make). Returns the lines to print."""
    repository = Path(repository).resolve()
    if served_parameters(repository, VERIFIER, overrides).get("cost_tables") != HOST_COST_TABLES:
        return []
    root = repository.parent
    dirs = {role: resolve_path(root, served_parameters(repository, role, overrides)["model_dir"])
            for role in STAGES}  # fmt: skip
    pair = prepare_pair(repository, dirs["draft"], dirs["target"])
    lines = resolve_auto_engine(repository, pair, overrides)
    return [*lines, *resolve_host_costs(repository, pair, overrides, CostOptions(cpu_threads))]
