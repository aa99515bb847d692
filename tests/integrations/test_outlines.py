"""outlines on a ggmoe model: ``outlines.from_llamacpp(ggmoe.load())`` needs no adapter."""

from __future__ import annotations

import re
from typing import Literal

import pytest
from pydantic import BaseModel

outlines = pytest.importorskip("outlines")  # in the dev extra (with numba, its numpy kernels)


class Mood(BaseModel):
    mood: Literal["happy", "sad"]
    certain: bool


@pytest.fixture(scope="module")
def generator(model):
    return outlines.from_llamacpp(model)


def test_plain_choice_and_regex(generator, llama_inits):
    assert isinstance(generator("Once upon a time", max_tokens=8), str)
    assert generator("Yes or no? ", Literal["yes", "no"], max_tokens=4) in ("yes", "no")
    assert re.fullmatch(r"[0-9]{3}", generator("A number: ", outlines.types.Regex(r"[0-9]{3}"), max_tokens=8))
    assert llama_inits == []


def test_json_schema(generator):
    out = generator("How do you feel? ", Mood, max_tokens=40)
    assert isinstance(Mood.model_validate_json(out), Mood)
