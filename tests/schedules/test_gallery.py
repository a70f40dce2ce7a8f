"""docs/schedules.md is what the gallery script generates (regenerate: python -m pipeplan.schedules.gallery docs/schedules.md)."""
from pathlib import Path

from pipeplan.schedules import KINDS
from pipeplan.schedules.gallery import gallery

DOC = Path(__file__).resolve().parents[2] / "docs" / "schedules.md"


def test_docs_are_up_to_date_and_cover_every_kind():
    text = gallery()
    assert DOC.read_text(encoding="utf-8") == text, "regenerate docs/schedules.md with the gallery script"
    for kind in KINDS:
        assert f"### {kind}\n" in text
    assert "whole iteration" in text and "lower bound" in text
