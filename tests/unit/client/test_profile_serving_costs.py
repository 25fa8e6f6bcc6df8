"""client/profile_serving_costs.py without a server: an unreachable one, bad arguments."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.client_scripts import load_profile_serving_costs


def test_unreachable_server_is_a_clear_error(tmp_path: Path, capsys):
    rc = load_profile_serving_costs().main([
        "--http-url", "http://127.0.0.1:9", "--metrics-url", "http://127.0.0.1:9/metrics",
        "--concurrency", "1", "--draft-tokens", "2", "--out", str(tmp_path / "c.json"),
    ])  # fmt: skip
    assert rc == 2 and "error:" in capsys.readouterr().err
    assert not (tmp_path / "c.json").exists()


@pytest.mark.parametrize("bad", [["--concurrency", "0"], ["--draft-tokens", "a,b"]])
def test_bad_arguments(tmp_path: Path, bad: list[str]):
    with pytest.raises(SystemExit):
        load_profile_serving_costs().main([*bad, "--out", str(tmp_path / "c")])
