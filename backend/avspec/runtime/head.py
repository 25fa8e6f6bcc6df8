"""A drafter that reads the target: an EAGLE-style head over the target's hidden states.

The target's last hidden state after its final norm at position t (its "feature" f_t, what its
output matrix turns into the logits of token t + 1) says more about token t + 2 than the
tokens alone do. The head drafts from it:

    x_t = fc([f_t ; embed(token_{t+1})])         # 2 x width -> width, no bias
    h_t = block(x_t)                              # one decoder block, causal over the row
    f^_{t+1} = final_norm(h_t)                    # the head's guess of the target's f_{t+1}
    logits = f^_{t+1} @ E[kept]^T                 # the target's output matrix, kept ids only

`embed` and `E` are the target's own (tied) embedding, frozen and shared, never shipped with the
head; `kept` is the draft vocabulary's kept ids (`avspec.engine.draft_vocab`), or every id. The
head drafts its second token from its own guess: [f^_{t+1} ; embed(drafted token_{t+2})], and so
on. Its block keeps its own KV cache, one layer deep, written from the target's features for
every accepted position and from its own guesses for the drafts of a step.

`DraftHead` holds the trained parts (`fc`, `block`, `final_norm`) in a one-block `Transformer`
(`layers`, whose embedding is the target's), so the dense training path (`Block.forward`) and
the served cached path (`Transformer.forward_cached` with `embeds`) are the runtime's own.

Files: `head.safetensors` (the trained tensors, `fc.weight` and the one-block transformer's
`blocks.0.*` and `final_norm.weight`) and `head.json` (`HeadSpec`: the target's config with
one layer, the block the head was initialised from, the kept-id file), both committed; and
`embedding.safetensors`, the target's embedding copied in from the target's checkpoint
(`write_embedding`, by `make models`), so a served head directory loads on its own
(`load_head_dir`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from avspec.runtime.kv_cache import KVCache
from avspec.runtime.transformer import Transformer, TransformerConfig

WEIGHTS_FILE = "head.safetensors"
SPEC_FILE = "head.json"
EMBEDDING_FILE = "embedding.safetensors"  # the target's, copied in by `write_embedding`
KIND = "eagle"


@dataclass(frozen=True)
class HeadSpec:
    """What a head is: `config` (the target's, one layer), how it was made (`init_layer`: the
    target block its block started from), `draft_vocab` (a kept-id file beside it, or None)."""

    config: TransformerConfig
    init_layer: int = 0
    draft_vocab: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"kind": KIND, "config": self.config.to_dict(), "init_layer": self.init_layer,
                "draft_vocab": self.draft_vocab}  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HeadSpec:
        if data.get("kind") != KIND:
            raise ValueError(f"{SPEC_FILE}: kind must be {KIND!r}, got {data.get('kind')!r}")
        config = TransformerConfig.from_dict(data["config"])
        return cls(config, int(data.get("init_layer", 0)), data.get("draft_vocab"))


def head_config(target: TransformerConfig) -> TransformerConfig:
    """The head's one-block config: the target's width, heads, MLP and rotary, one layer."""
    return dataclasses.replace(target, num_layers=1)


class DraftHead(nn.Module):
    """See the module docstring. `layers.embed` is the target's embedding (frozen)."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        if config.num_layers != 1:
            raise ValueError(f"a draft head has one block, its config says {config.num_layers}")
        self.layers = Transformer(config)
        self.fc = nn.Linear(2 * config.width, config.width, bias=False)

    @property
    def config(self) -> TransformerConfig:
        return self.layers.config

    @property
    def vocab_size(self) -> int:
        return self.layers.vocab_size

    def inputs(self, features: Tensor, tokens: Tensor) -> Tensor:
        """[..., width] features and [...] token ids -> the block's input [..., width]."""
        embedded = self.layers.embed(tokens).to(features.dtype)
        return self.fc(torch.cat([features, embedded], dim=-1))

    def forward(self, features: Tensor, tokens: Tensor) -> Tensor:
        """Dense, from position 0, causal: features [batch, seq, width] (f_t) and tokens
        [batch, seq] (token t + 1) -> the guessed features f^_{t+1} [batch, seq, width]."""
        x = self.layers.blocks[0](self.inputs(features, tokens), self.layers.rotary)
        return self.layers.final_norm(x)

    def forward_cached(
        self, cache: KVCache, seq_ids: list[int], features: Tensor, tokens: Tensor,
        lengths: list[int],
    ) -> Tensor:  # fmt: skip
        """The cached path (`Transformer.forward_cached`'s packing): features [tokens, width]
        and tokens [tokens] appended after each row's cached positions -> f^ [tokens, width]."""
        x = self.inputs(features, tokens)
        hidden = self.layers.forward_cached(cache, seq_ids, tokens, lengths, hidden=True, embeds=x)
        return self.layers.final_norm(hidden)

    def logits(self, guessed: Tensor, rows: Tensor | None = None) -> Tensor:
        """f^ [..., width] -> logits through the target's output matrix (its rows `rows`
        [kept, width] only when given)."""
        matrix = self.layers.embed.weight if rows is None else rows
        return guessed @ matrix.to(guessed.dtype).t()


def new_head(target: Transformer, init_layer: int = 0) -> DraftHead:
    """A float32 head for `target`: its embedding (frozen), final norm and block `init_layer`
    copied, `fc` passing the token's embedding through (identity on that half, small noise on
    the feature half), so training starts from a one-block language model."""
    if not target.config.tie_embeddings:
        raise ValueError("a draft head needs a target with tied embeddings (its output matrix)")
    if not 0 <= init_layer < target.config.num_layers:
        raise ValueError(f"init_layer {init_layer}: the target has 0..{target.config.num_layers}")
    head = DraftHead(head_config(target.config))
    width = target.config.width
    with torch.no_grad():
        head.layers.embed.weight.copy_(target.embed.weight)
        head.layers.final_norm.weight.copy_(target.final_norm.weight)
        block = target.blocks[init_layer].state_dict()
        head.layers.blocks[0].load_state_dict({k: v.float() for k, v in block.items()})
        head.fc.weight[:, :width].normal_(0.0, 0.02 / width**0.5)
        head.fc.weight[:, width:].copy_(torch.eye(width))
    head.layers.embed.weight.requires_grad_(False)
    return head


def trained_state(head: DraftHead) -> dict[str, Tensor]:
    """The tensors a head ships with (everything but the target's embedding)."""
    return {k: v for k, v in head.state_dict().items() if k != "layers.embed.weight"}


def save_head(head: DraftHead, spec: HeadSpec, out: Path | str) -> None:
    """Write `head.safetensors` (bfloat16) and `head.json` into `out`."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in trained_state(head).items()}
    save_file(state, str(out / WEIGHTS_FILE))
    (out / SPEC_FILE).write_text(json.dumps(spec.to_dict(), indent=1) + "\n")


def load_head(
    head_dir: Path | str, target: Transformer, dtype: torch.dtype = torch.float32
) -> tuple[DraftHead, HeadSpec]:
    """The head in `head_dir` over `target`'s embedding (shared, not copied when the dtypes
    agree): ValueError naming a missing file, another target's shape, or a missing tensor."""
    from safetensors.torch import load_file

    head_dir = Path(head_dir)
    for name in (WEIGHTS_FILE, SPEC_FILE):
        if not (head_dir / name).is_file():
            raise ValueError(f"{head_dir}: no {name} (not a draft head directory)")
    spec = HeadSpec.from_dict(json.loads((head_dir / SPEC_FILE).read_text()))
    want = head_config(target.config)
    if dataclasses.replace(spec.config, max_length=want.max_length) != want:
        raise ValueError(f"{head_dir}: the head was made for another target's shape")
    head = DraftHead(want).to(dtype)
    state = load_file(str(head_dir / WEIGHTS_FILE))
    missing = set(trained_state(head)) - set(state)
    if missing:
        raise ValueError(f"{head_dir}: {WEIGHTS_FILE} lacks {sorted(missing)[0]}")
    head.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    head.layers.embed.weight = target.embed.weight  # shared
    head.layers.embed.weight.requires_grad_(False)
    return head.eval(), spec


def is_head_dir(path: Path | str) -> bool:
    """Whether `path` is a draft head directory (it holds `head.json`)."""
    return (Path(path) / SPEC_FILE).is_file()


def write_embedding(target: Transformer, head_dir: Path | str) -> None:
    """Copy the target's embedding into `head_dir` (bfloat16), for `load_head_dir`."""
    from safetensors.torch import save_file

    weight = target.embed.weight.detach().to(torch.bfloat16).contiguous()
    save_file({"embed.weight": weight}, str(Path(head_dir) / EMBEDDING_FILE))


def load_head_dir(
    head_dir: Path | str,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    max_length: int | None = None,
) -> DraftHead:
    """The head in `head_dir` with the target embedding copied beside it, in `dtype` on
    `device`, its rotary tables for `max_length` positions (None: as saved): ValueError naming
    a missing file (`make models` writes the embedding)."""
    from safetensors.torch import load_file

    head_dir = Path(head_dir)
    for name in (WEIGHTS_FILE, SPEC_FILE, EMBEDDING_FILE):
        if not (head_dir / name).is_file():
            raise ValueError(f"{head_dir}: no {name} (a draft head directory needs it)")
    spec = HeadSpec.from_dict(json.loads((head_dir / SPEC_FILE).read_text()))
    config = spec.config
    if max_length is not None:
        config = dataclasses.replace(config, max_length=max_length)
    head = DraftHead(config)
    state = load_file(str(head_dir / WEIGHTS_FILE))
    state["layers.embed.weight"] = load_file(str(head_dir / EMBEDDING_FILE))["embed.weight"]
    missing = set(head.state_dict()) - set(state)
    if missing:
        raise ValueError(f"{head_dir}: {WEIGHTS_FILE} lacks {sorted(missing)[0]}")
    head.load_state_dict(state)
    head.layers.embed.weight.requires_grad_(False)
    return head.to(device, dtype).eval()
