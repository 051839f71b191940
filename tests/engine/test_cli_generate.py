"""`tailwatch generate`: text or stdin, --json, bad input exits 2 with one line."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from monitor.cli.generate import generate


def test_generate_json_from_argument_and_stdin(tiny_dirs):
    runner = CliRunner()
    args = ["--model-dir", str(tiny_dirs["target"]), "--no-draft", "--max-new-tokens", "5",
            "--json"]
    out = runner.invoke(generate, ["hello", *args])
    assert out.exit_code == 0, out.output
    result = json.loads(out.output)
    assert result["output_tokens"] <= 5 and result["input_tokens"] == 6
    assert result["path"] == "eager" and result["bucket"] == "16"
    piped = runner.invoke(generate, args, input="hello")
    assert json.loads(piped.output)["output_ids"] == result["output_ids"]


@pytest.mark.parametrize(("args", "field"), [
    (["", "--max-new-tokens", "3"], "text"),
    (["hi", "--max-new-tokens", "0"], "max_new_tokens"),
    (["hi", "--max-new-tokens", "100000"], "max_new_tokens"),
])
def test_bad_input_exits_2_naming_the_field(tiny_dirs, args, field):
    out = CliRunner().invoke(generate, [*args, "--model-dir", str(tiny_dirs["target"]), "--no-draft"])
    assert out.exit_code == 2
    lines = out.output.strip().splitlines()
    assert len(lines) == 1 and field in lines[0] and "Traceback" not in out.output
