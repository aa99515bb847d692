"""ggmoe inside the code people already write for llama-cpp-python: ``ggmoe.load`` under ``Llama``'s keyword
names, ``ggmoe.models`` after a plain ``import ggmoe``."""

from __future__ import annotations

import subprocess
import sys

import pytest

import ggmoe
from ggmoe.base.errors import UsageError
from ggmoe.models import default_model_path


def test_models_is_reachable_from_a_plain_import_and_stays_light():
    code = ("import sys, ggmoe; p = ggmoe.models.default_model_path(); "
            "print(p.name, 'llama_cpp' in sys.modules, 'numpy' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["tiny-moe.gguf", "False", "False"]


def test_load_takes_llamas_model_path():
    with ggmoe.load(model_path=default_model_path(), n_ctx=64) as llm:
        assert llm.model_path == str(default_model_path())
        assert llm.create_completion("Once", max_tokens=2, temperature=0)["choices"][0]["text"] is not None


def test_path_and_model_path_together_is_one_usage_error():
    with pytest.raises(UsageError, match="path or as model_path, not both"):
        ggmoe.load(default_model_path(), model_path=default_model_path())


def test_load_takes_a_chat_template_or_its_name():
    import llama_cpp

    with ggmoe.load(n_ctx=64, chat_template="chatml") as llm:
        assert llm.chat_formatter().template == llama_cpp.llama_chat_format.CHATML_CHAT_TEMPLATE
        prompt = llm.chat_formatter()(messages=[{"role": "user", "content": "Hi"}]).prompt
        assert prompt.startswith("<|im_start|>user\nHi")
    with pytest.raises(UsageError, match="does not parse"):
        ggmoe.load(chat_template="{% if %}")
