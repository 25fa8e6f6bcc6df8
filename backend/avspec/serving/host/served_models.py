"""Which models a tritonserver loads from its repositories, with which configuration.

Triton serves several repositories together (a model name may appear in only one) and, under
`--model-config-name=NAME`, reads `<model>/configs/NAME.pbtxt` where it exists, `config.pbtxt`
otherwise (the GPU deployment's `gpu` variants, docs/gpu.md). The Python-backend models among
them are the ones with stub processes, which the stage supervisor watches.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path

_PYTHON_BACKEND = re.compile(r'^\s*backend:\s*"python"', re.MULTILINE)


def repository_models(repository: Path) -> list[str]:
    """Return the names of the models (directories with a config.pbtxt) in `repository`."""
    return sorted(p.parent.name for p in repository.glob("*/config.pbtxt"))


def model_config_file(model_dir: Path, config_name: str | None = None) -> Path:
    """The configuration Triton reads for a model under `--model-config-name=config_name`.

    That is `configs/<config_name>.pbtxt` where it exists, `config.pbtxt` otherwise.
    """
    if config_name:
        named = model_dir / "configs" / f"{config_name}.pbtxt"
        if named.is_file():
            return named
    return model_dir / "config.pbtxt"


def runs_on_python_backend(model_dir: Path, config_name: str | None = None) -> bool:
    """Whether the model's configuration (under `config_name`) names the Python backend."""
    return bool(_PYTHON_BACKEND.search(model_config_file(model_dir, config_name).read_text()))


def python_models(repository: Path, config_name: str | None = None) -> list[str]:
    """The models of `repository` run by the Python backend (one stub process per instance)."""
    models = repository_models(repository)
    return [m for m in models if runs_on_python_backend(repository / m, config_name)]


def locate_models(repositories: Sequence[Path], models: Iterable[str]) -> dict[str, Path]:
    """Map each model to the repository holding it; ValueError if in none or in several."""
    held = {repository: set(repository_models(repository)) for repository in repositories}
    homes = {}
    for model in models:
        found = [repository for repository, names in held.items() if model in names]
        if len(found) != 1:
            where = "none of" if not found else "several of"
            names = ", ".join(str(r) for r in repositories)
            raise ValueError(f"model {model!r} is in {where} the repositories ({names})")
        homes[model] = found[0]
    return homes


def models_to_load(
    repositories: Sequence[Path], load_models: Sequence[str] | None = None
) -> tuple[list[str], dict[str, Path]]:
    """The models a server loads (`load_models`, or every model of `repositories`) and the
    repository of each; ValueError for a repository that is not a directory, no model at all,
    or a model in none or in several of the repositories."""
    for repository in repositories:
        if not repository.is_dir():
            raise ValueError(f"model repository {repository} is not a directory")
    every = [m for r in repositories for m in repository_models(r)]
    models = list(load_models) if load_models is not None else sorted(every)
    if not models:
        names = ", ".join(str(r) for r in repositories)
        raise ValueError(f"no model (*/config.pbtxt) to load in {names}")
    return models, locate_models(repositories, models)
