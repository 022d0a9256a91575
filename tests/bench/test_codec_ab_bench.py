"""`python -m bench.codec_ab` and `bench.codec_floor` at their smallest: two real child
processes taking turns give a row per figure with consistent ratios, and the floor's exact
emulation of torch's float8 cast (a claim in docs/performance.md) holds on its sample."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import codec_ab, codec_floor
from tests import ROOT


@pytest.mark.slow
def test_codec_ab_times_both_checkouts_in_turn(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ab.json"
    assert codec_ab.main(["--before", str(ROOT), "--after", str(ROOT), "--rounds", "2", "--blocks", "1",
                          "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {row[0]: row for row in result["rows"]}
    assert set(rows) == {"memcpy"} | {f"{k} {f}" for k in codec_ab.KINDS for f in codec_ab.FIGURES}
    for name, a, b, ratio, *_ in rows.values():
        assert a > 0 and b > 0 and ratio == pytest.approx(b / a, abs=0.01), name
    assert all(fig["batches"] == 2 and 0 < fig["best"] <= fig["median"]
               for side in result["seconds"].values() for fig in side.values())
    assert "fp8 encode_streamed" in capsys.readouterr().out


def test_codec_floor_emulation_of_the_float8_cast_is_exact() -> None:
    assert codec_floor.check_emulation()


def test_codec_ab_refuses_a_folder_without_codecs(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        codec_ab.main(["--before", str(tmp_path), "--after", str(ROOT), "--rounds", "1"])
